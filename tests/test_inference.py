"""ask_about_video: the question goes through the training data path (PyAV sampling, chat template, processor), so
the answer is what `model.generate` returns on the inputs the trainer builds for the same clip."""

import pytest
import torch

from rollplex_trl.data import (
    RollplexDataError,
    SyntheticVideoConfig,
    VideoSamplingConfig,
    load_video_r1,
    write_synthetic_video_dataset,
)
from rollplex_trl.inference import (
    answer_token_ids,
    ask_about_video,
    sampling_from_config,
    video_question_inputs,
)

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vl_path)).eval()
    return model, AutoProcessor.from_pretrained(str(tiny_vl_path))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    annotations = write_synthetic_video_dataset(
        tmp_path_factory.mktemp("clips"), SyntheticVideoConfig(num_samples=2, num_frames=8, height=56, width=56))
    return load_video_r1(annotations)


def _training_config(tmp_path):
    from rollplex_trl import RollplexGRPOConfig

    return RollplexGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                              rollplex_video_max_frames=4, rollplex_video_min_pixels=3136,
                              rollplex_video_max_pixels=3136)


def _training_path_inputs(processor, dataset, config) -> dict:
    """What the trainer builds for row 0: its dataset wrapper, then TRL's transformers-generate input layout."""
    from rollplex_trl.config import rollplex_options
    from rollplex_trl.data.prepared import PREPARED_KEY, PreparedPromptDataset
    from rollplex_trl.data.prompt import generation_fields
    from rollplex_trl.trainers.media import media_options

    wrapped = PreparedPromptDataset(dataset, processor, media_options(rollplex_options(config), None, None))
    prompt = wrapped[0][PREPARED_KEY]
    fields = generation_fields([prompt])
    return {"input_ids": torch.tensor([prompt.prompt_ids]),
            "attention_mask": torch.ones(1, prompt.num_prompt_tokens, dtype=torch.long),
            "mm_token_type_ids": torch.tensor(fields.pop("mm_token_type_ids")), **fields}


def test_answer_matches_generate_on_training_inputs(vl, clips, tmp_path):
    model, processor = vl
    config = _training_config(tmp_path)
    expected_inputs = _training_path_inputs(processor, clips, config)
    with torch.no_grad():
        out = model.generate(**expected_inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    expected_ids = out[0, expected_inputs["input_ids"].size(1):].tolist()

    row = clips[0]
    inputs = video_question_inputs(processor, row["video"], row["prompt"], sampling=sampling_from_config(config))
    assert inputs.keys() == expected_inputs.keys()
    for key, value in expected_inputs.items():  # the same frames, pixels, tokens and M-RoPE timing
        assert torch.equal(inputs[key], value), key
    assert expected_inputs["video_grid_thw"][0, 0].item() == 2  # 4 frames, merged 2 per temporal patch
    assert answer_token_ids(model, inputs, max_new_tokens=MAX_NEW_TOKENS) == expected_ids

    answer = ask_about_video(model, processor, row["video"], row["prompt"], sampling=sampling_from_config(config),
                             max_new_tokens=MAX_NEW_TOKENS)
    assert answer == processor.batch_decode([expected_ids], skip_special_tokens=True)[0].strip()


def test_plain_question_and_sampling_overrides(vl, clips):
    model, processor = vl
    path = clips[1]["video"]
    default = video_question_inputs(processor, path, "What moves?")
    # the training defaults (2 fps, at least 4 frames): 4 frames, merged 2 per temporal patch
    assert default["video_grid_thw"][0, 0].item() == 2
    eight = VideoSamplingConfig(min_frames=8, max_frames=8, min_pixels=3136, max_pixels=3136)
    more = video_question_inputs(processor, path, "What moves?", sampling=eight)
    assert more["video_grid_thw"][0, 0].item() == 4
    answer = ask_about_video(model, processor, path, "What moves?", min_frames=8, max_frames=8, min_pixels=3136,
                             max_pixels=3136, max_new_tokens=4)
    assert isinstance(answer, str)


def test_missing_video_is_a_named_error(vl, tmp_path):
    model, processor = vl
    missing = tmp_path / "nope.mp4"
    with pytest.raises(RollplexDataError, match=r"nope\.mp4.*file not found"):
        ask_about_video(model, processor, missing, "What is in the video?")


def test_ask_a_saved_checkpoint_with_its_training_sampling(tiny_vl_path, clips, tmp_path, capsys, caplog):
    """A video run records its frame sampling in the saved model's config; `rollplex-trl ask` reads it, so the
    question's frames are the training's (non-default bounds here), and an override is used and logged."""
    import logging

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rollplex_trl import RollplexGRPOConfig, RollplexGRPOTrainer
    from rollplex_trl.cli import main as cli_main
    from rollplex_trl.inference import sampling_from_checkpoint

    args = RollplexGRPOConfig(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, bf16=False, max_steps=1,
                              per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
                              save_strategy="no", rollplex_video_max_frames=4, rollplex_video_min_pixels=3136,
                              rollplex_video_max_pixels=3136)
    trainer = RollplexGRPOTrainer(model=str(tiny_vl_path), reward_funcs=lambda completions, **k: [0.0] * len(
        completions), args=args, train_dataset=clips)
    trainer.train()
    final = tmp_path / "final"
    trainer.save_model(str(final))
    capsys.readouterr()  # the training's own output
    recorded = sampling_from_checkpoint(final)
    assert recorded == sampling_from_config(args)
    assert sampling_from_checkpoint(tiny_vl_path) is None  # never trained here: nothing recorded

    model = AutoModelForImageTextToText.from_pretrained(str(final)).eval()
    processor = AutoProcessor.from_pretrained(str(final))
    video = clips[0]["video"]
    expected = ask_about_video(model, processor, video, "What moves?", sampling=recorded, max_new_tokens=4)
    default = video_question_inputs(processor, video, "What moves?")
    trained = video_question_inputs(processor, video, "What moves?", sampling=recorded)
    assert not torch.equal(default["video_grid_thw"], trained["video_grid_thw"]) or not torch.equal(
        default["pixel_values_videos"], trained["pixel_values_videos"]), "the test needs non-default sampling"

    assert cli_main(["ask", "--checkpoint", str(final), "--video", video, "--max-new-tokens", "4",
                     "What moves?"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    with caplog.at_level(logging.WARNING, logger="rollplex_trl"):
        assert cli_main(["ask", "--checkpoint", str(final), "--video", video, "--max-new-tokens", "4",
                         "--max-frames", "8", "--min-frames", "8", "What moves?"]) == 0
    assert "max_frames=8" in caplog.text and "differs from the checkpoint's training" in caplog.text
