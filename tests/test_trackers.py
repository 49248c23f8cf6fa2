"""Trackers: `report_to=["tensorboard"]` logs the rollplex/* metrics, and TimelineImageCallback adds the phase
timeline as an image (read back with TensorBoard's EventAccumulator)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import require

require("tensorboard", reason="tensorboard is not installed (pip install -e '.[dev]')")

from rollplex_trl.callbacks.trackers import TimelineImageCallback  # noqa: E402
from rollplex_trl.overlap import Span, Timeline  # noqa: E402


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted({p.parent for p in folder.rglob("events.out.tfevents.*")})
    assert runs, f"no TensorBoard event files under {folder}"
    accumulators = []
    for run in runs:
        acc = EventAccumulator(str(run), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        accumulators.append(acc)
    return accumulators


def test_tensorboard_gets_rollplex_metrics_and_timeline_image(tiny_qwen2_path, tmp_path):
    from datasets import Dataset

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.data.toy import toy_rows

    def reward(completions, **kwargs):
        return [float(len(str(c)) % 3) for c in completions]

    args = RollplexGRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=4, logging_steps=1, report_to=["tensorboard"], use_cpu=True, bf16=False,
        gradient_checkpointing=False, save_strategy="no", seed=0)
    callback = TimelineImageCallback(every_n_steps=1)  # added as a user adds it: it finds its trainer itself
    trainer = RollplexGRPOTrainer(model=str(tiny_qwen2_path), reward_funcs=reward, args=args,
                                  train_dataset=Dataset.from_list(toy_rows("text", 8)), callbacks=[callback])
    trainer.train()

    assert callback.trainer is trainer
    # steps 1 and 2 through the run's open writer, then the end of training through a second writer
    assert callback.logged == [("tensorboard", 1), ("tensorboard", 2), ("tensorboard", 2)]
    accumulators = _events(tmp_path / "run")
    scalars = {tag for acc in accumulators for tag in acc.Tags()["scalars"]}
    rollplex = {tag for tag in scalars if "rollplex/" in tag}
    assert {"train/rollplex/decode_s", "train/rollplex/prefix_rows_per_prompt"} <= rollplex, sorted(scalars)
    images = [event for acc in accumulators if "rollplex/timeline" in acc.Tags()["images"]
              for event in acc.Images("rollplex/timeline")]
    assert sorted(e.step for e in images) == [1, 2, 2]
    assert all(e.width > 100 and e.height > 50 and e.encoded_image_string[:4] == b"\x89PNG" for e in images)


def test_bound_callback_logs_after_the_writer_closed(tmp_path):
    """Added by the trainer (bound to it): at the end of training TensorBoard's own writer is closed; the image goes
    to a second event file in the same folder. Trackers that are not installed or not reported to are skipped."""
    from transformers.integrations import TensorBoardCallback

    timeline = Timeline()
    timeline.add(Span("micro-step", "step", 0.0, 1.0))
    timeline.add(Span("decode", "decode", 0.1, 0.6))
    tb = TensorBoardCallback()
    tb.logging_dir = str(tmp_path / "tb")  # what its on_train_begin sets; its writer was closed at train end
    trainer = SimpleNamespace(timeline=timeline, callback_handler=SimpleNamespace(callbacks=[tb]))
    callback = TimelineImageCallback(trainer)
    state = SimpleNamespace(is_world_process_zero=True, global_step=7)
    callback.log_timeline(SimpleNamespace(report_to=["tensorboard", "mlflow"]), state)
    assert callback.logged == [("tensorboard", 7)]
    (acc,) = _events(tmp_path / "tb")
    assert [e.step for e in acc.Images("rollplex/timeline")] == [7]

    callback.log_timeline(SimpleNamespace(report_to="none"), state)  # no image tracker: nothing rendered
    callback.log_timeline(SimpleNamespace(report_to=["tensorboard"]), SimpleNamespace(is_world_process_zero=False,
                                                                                      global_step=8))
    assert callback.logged == [("tensorboard", 7)]


def test_every_n_steps_is_checked():
    with pytest.raises(ValueError, match="every_n_steps"):
        TimelineImageCallback(every_n_steps=0)
