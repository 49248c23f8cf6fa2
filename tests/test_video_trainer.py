"""Video through RollplexGRPOTrainer: log-probs equal a plain full forward, and gradients reach the vision tower."""

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image

from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
from rollplex_trl.data.video import VideoSamplingConfig, load_video

from helpers import reference_logps, write_mp4


def varied_reward(completions, **kwargs):
    return [float(len(c[0]["content"]) % 5) for c in completions]


def _config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, learning_rate=1e-3, beta=0.1, logging_steps=1, report_to=[], seed=3,
        use_cpu=True, bf16=False, save_strategy="no", gradient_checkpointing=False,
        rollplex_video_min_pixels=4 * 28 * 28, rollplex_video_max_pixels=56 * 84,
    )
    kwargs.update(overrides)
    return RollplexGRPOConfig(**kwargs)


@pytest.fixture()
def video_rows(tmp_path):
    """Two prompts with videos of different sizes (different visual token counts: left padding is exercised)."""
    clip_a = write_mp4(tmp_path / "a.mp4", num_frames=8, height=56, width=56, fps=4, seed=1)
    clip_b = write_mp4(tmp_path / "b.mp4", num_frames=12, height=56, width=84, fps=4, seed=2)
    return [
        {"problem_id": 10, "video": str(clip_a),
         "prompt": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "How many?"}]}]},
        {"problem_id": 11, "video": str(clip_b),
         # no video part: the trainer inserts it before the text, as TRL does for images
         "prompt": [{"role": "user", "content": [{"type": "text", "text": "Which way does it move?"}]}]},
    ]


def _generation_batch(trainer, indices):
    trainer.model.train()
    return trainer._generate_and_score_completions([trainer.train_dataset[i] for i in indices])


def _reference_rows(trainer, rows, config):
    sampling = VideoSamplingConfig(fps=config.rollplex_video_fps, min_frames=config.rollplex_video_min_frames,
                                   max_frames=config.rollplex_video_max_frames,
                                   min_pixels=config.rollplex_video_min_pixels,
                                   max_pixels=config.rollplex_video_max_pixels)
    processor = trainer.processing_class
    out = []
    for row in rows:
        messages = row["prompt"]
        parts = messages[0]["content"]
        if row.get("video") and not any(p["type"] == "video" for p in parts):  # inserted before the text
            messages = [{"role": "user", "content": [{"type": "video"}, *parts]}]
        media = {"text": processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)}
        if row.get("video"):
            media["videos"] = [load_video(row["video"], sampling)]
        if row.get("image") is not None:
            media["images"] = [row["image"]]
        out.append(media)
    return out


def test_video_logps_match_full_forward_and_grads_reach_vision_tower(tiny_vl_path, tmp_path, video_rows):
    config = _config(tmp_path)
    dataset = Dataset.from_list(video_rows)
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=varied_reward, args=config,
                                  train_dataset=dataset)
    batch = _generation_batch(trainer, [0, 0, 1, 1])
    rows = batch["rollplex_prompt"]
    assert rows[0] is rows[1] and rows[2] is rows[3], "the G rows of a prompt share one prepared prompt"
    assert rows[0].video_grid_thw.tolist() != rows[2].video_grid_thw.tolist()

    ref_rows = _reference_rows(trainer, [video_rows[i] for i in (0, 0, 1, 1)], config)
    pad_id = trainer.processing_class.tokenizer.pad_token_id
    cmask = batch["completion_mask"]
    with torch.no_grad():
        expected_ref = reference_logps(trainer.ref_model, trainer.processing_class, ref_rows,
                                       batch["completion_ids"], cmask, pad_id)
    diff = ((batch["ref_per_token_logps"] - expected_ref).abs() * cmask).max().item()
    assert diff <= 1e-5, f"reference log-probs differ from the full forward by {diff}"

    # The same check has to be able to fail: without the video inputs (TRL 1.16's behaviour) they are far off.
    with torch.no_grad():
        no_video = reference_logps(trainer.ref_model, trainer.processing_class, ref_rows, batch["completion_ids"],
                                   cmask, pad_id, drop_vision=True)
    assert ((no_video - expected_ref).abs() * cmask).max().item() > 1e-3

    # Actor pass (with grad) through TRL's loss, on a micro-batch after TRL's shuffle/split.
    model = trainer.model
    model.zero_grad()
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], cmask], 1)
    with trainer.batch.scoring(rows):
        actor_logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, cmask.size(1), compute_entropy=True)
    expected_actor = reference_logps(model, trainer.processing_class, ref_rows, batch["completion_ids"], cmask,
                                     pad_id)
    assert ((actor_logps - expected_actor).abs() * cmask).max().item() <= 1e-5
    assert entropies is not None and entropies.shape == actor_logps.shape

    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; this test calls the loss directly
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    visual = {n: p for n, p in model.named_parameters() if ".visual." in f".{n}"}
    assert visual, "no vision-tower parameters found"
    missing = [n for n, p in visual.items() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, f"vision-tower parameters without gradient: {missing}"


def test_mixed_image_and_video_rows(tiny_vl_path, tmp_path, video_rows):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8))
    image_path = tmp_path / "img.png"
    image.save(image_path)
    rows = [dict(video_rows[0], image=None),
            {"problem_id": 12, "video": None, "image": str(image_path),
             "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]}]
    config = _config(tmp_path)
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=varied_reward, args=config,
                                  train_dataset=Dataset.from_list(rows))
    batch = _generation_batch(trainer, [0, 0, 1, 1])
    assert batch["rollplex_prompt"][2].image_grid_thw is not None
    ref_rows = _reference_rows(trainer, [dict(rows[i], image=Image.open(image_path).convert("RGB")
                                              if rows[i]["image"] else None) for i in (0, 0, 1, 1)], config)
    with torch.no_grad():
        expected = reference_logps(trainer.ref_model, trainer.processing_class, ref_rows, batch["completion_ids"],
                                   batch["completion_mask"], trainer.processing_class.tokenizer.pad_token_id)
    diff = ((batch["ref_per_token_logps"] - expected).abs() * batch["completion_mask"]).max().item()
    assert diff <= 1e-5


def test_video_training_runs_and_changes_vision_weights(tiny_vl_path, tmp_path, video_rows):
    config = _config(tmp_path, max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=varied_reward, args=config,
                                  train_dataset=Dataset.from_list(video_rows * 2))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" in n}
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 2 and all(np.isfinite(r["loss"]) for r in logs)
    assert all("rollplex/skipped_samples" in r for r in logs)
    changed = [n for n, p in trainer.model.named_parameters() if "visual" in n and not torch.equal(p, before[n])]
    assert changed, "no vision-tower weight changed during training"


@pytest.mark.parametrize("share", ["auto", "off"])
def test_video_evaluation(tiny_vl_path, tmp_path, video_rows, share):
    config = _config(tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                     rollplex_share_prefix=share)
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=varied_reward, args=config,
                                  train_dataset=Dataset.from_list(video_rows),
                                  eval_dataset=Dataset.from_list(video_rows))
    trainer.train()
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    assert evals and np.isfinite(evals[0]["eval_loss"]) and "eval_reward" in evals[0]
