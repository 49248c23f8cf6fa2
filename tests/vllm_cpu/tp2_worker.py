"""One rank of the TP = 2 check, launched by test_vllm_tp2.py under torchrun (vLLM's external_launcher backend).

Both ranks hold the full trainer model (as data-parallel trainer ranks do), take the same optimizer step, sync into
their vLLM shard (q/k/v heads, gate/up rows, o/down columns and vocabulary rows of this rank) and check vLLM's
log-probs against the trainer's. Prints one JSON line per rank.
"""

import json
import os
import sys

import torch


def main(checkpoint: str, out_dir: str) -> None:
    sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "..")]
    import conftest  # noqa: F401  (the tier's environment settings)
    from transformers import AutoModelForCausalLM

    from rollplex_trl.rollout.vllm_engine import VLLMColocateEngine, VLLMEngineConfig

    from vllm_helpers import SEQUENCES, max_gap, optimizer_step

    engine = VLLMColocateEngine(VLLMEngineConfig(model=checkpoint, dtype="float32", enforce_eager=True,
                                                 tensor_parallel_size=2, max_model_len=256, max_num_seqs=8,
                                                 seed=0))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    engine.sync_weights(model, version=0)
    before_step = max_gap(engine, model, SEQUENCES)
    optimizer_step(model, seed=11)
    stale = max_gap(engine, model, SEQUENCES)
    metrics = engine.sync_weights(model, version=1)
    after = max_gap(engine, model, SEQUENCES)
    rank = int(os.environ["RANK"])
    # one file per rank: lines the two ranks print at the same moment can interleave on a shared stdout
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "before_step": before_step, "stale": stale, "after": after,
                   "bytes": metrics["rollplex/weight_sync_bytes"], "seconds": metrics["rollplex/weight_sync_s"],
                   "aliased": engine.weight_sync.aliased_names}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
