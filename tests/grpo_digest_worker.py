"""One process of the multi-process `rollplex-trl grpo` test: the script's own `main`, then a digest of this rank's
weights in `<output_dir>/weights-rank<R>.txt`, so that the test can compare the ranks after the run."""

import faulthandler
import hashlib
import os
import sys

from rollplex_trl import grpo_script


def varied_reward(completions, **kwargs) -> list[float]:
    """Different completions, different rewards: non-zero advantages, so the step moves the weights."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def weights_digest(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def native_thread_names() -> list[str]:
    """This process's OS threads by name (Linux): gloo's are `gloo_tcp_loop` and `pt_gloo_runloop`."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


if __name__ == "__main__":
    faulthandler.enable()  # an abort at exit prints every thread's Python stack
    script_args, training_args, model_args, dataset_args = grpo_script.parse(sys.argv[1:])
    trainer = grpo_script.main(script_args, training_args, model_args, dataset_args)
    rank = int(os.environ.get("RANK", "0"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    with open(os.path.join(training_args.output_dir, f"weights-rank{rank}.txt"), "w") as f:
        f.write(f"{weights_digest(model)} {trainer.state.global_step} {int(os.environ.get('WORLD_SIZE', '1'))}\n")
    # main() ended with trainer.end(): no process-group thread may be left for the interpreter's teardown
    with open(os.path.join(training_args.output_dir, f"threads-rank{rank}.txt"), "w") as f:
        f.write(" ".join(native_thread_names()) + "\n")
