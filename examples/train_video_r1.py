"""GRPO on a Video-R1-format annotation file, with Video-R1's rewards and settings, using `RollplexGRPOTrainer`.

The data: Video-R1's own `Video-R1-260k.json` (or any JSON / JSONL file with its fields `problem_id, problem,
data_type, problem_type, options, solution, path, data_source`; `./...` paths resolved against `--data_root`, by
default the file's folder), read by `rollplex_trl.data.load_video_r1`; video and image rows may be mixed. The rewards:
`rollplex_trl.data.accuracy_reward` (per problem type, as Video-R1 scores) and `format_reward`
(`<think>...</think><answer>...</answer>`). The defaults are Video-R1's (`src/scripts/run_grpo_video.sh`): beta 0.04,
G = 8, completions up to 768 tokens, learning rate 1e-6 with a cosine schedule, weight decay 0.01, gradient-norm
clip 5, at most 16 frames of 128*28*28 pixels at 2 fps, T-GRPO and length control on (its `--temporal true
--len_control true`; `--rollplex_temporal false` turns T-GRPO off). Every `GRPOConfig` / `rollplex_*` field can be
overridden on the command line or in a YAML `--config`. Each logged step is appended to `<output_dir>/logs.jsonl`.

The model: `--model_name_or_path` (a local checkpoint, e.g. a downloaded Qwen2.5-VL-3B/7B-Instruct), or by default a
tiny Qwen2.5-VL built locally (`rollplex_trl.testing.checkpoints.get_checkpoint`, random weights; no model hub).

Run, on the real data (a GPU and a real checkpoint):
    accelerate launch examples/train_video_r1.py --annotations Video-R1-data/Video-R1-260k.json \\
        --model_name_or_path /models/Qwen2.5-VL-7B-Instruct --output_dir runs/video_r1 --bf16 true

Run, short and offline on CPU (the synthetic task is Video-R1-format: `rollplex-trl make-synthetic`):
    .venv/bin/rollplex-trl make-synthetic --output-dir runs/synthetic --num-samples 8 --frames 8
    HF_HUB_OFFLINE=1 .venv/bin/python examples/train_video_r1.py --annotations runs/synthetic/annotations.jsonl \\
        --output_dir runs/video_r1 --max_steps 2 --num_generations 4 --per_device_train_batch_size 4 \\
        --max_completion_length 32 --use_cpu --bf16 false --gradient_checkpointing false \\
        --rollplex_video_max_frames 8 --rollplex_video_min_pixels 3136 --rollplex_video_max_pixels 3136
"""

import os
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # checkpoints are local: get_checkpoint(...) or --model_name_or_path

# Video-R1's GRPO settings (src/scripts/run_grpo_video.sh); the command line overrides each.
VIDEO_R1_DEFAULTS = dict(
    beta=0.04,
    num_generations=8,
    per_device_train_batch_size=8,  # one prompt's G = 8 completions per device and step
    max_completion_length=768,
    learning_rate=1e-6,
    lr_scheduler_type="cosine",
    weight_decay=0.01,
    max_grad_norm=5.0,
    logging_steps=1,
    report_to="none",
    rollplex_video_fps=2.0,
    rollplex_video_max_frames=16,
    rollplex_video_max_pixels=128 * 28 * 28,
    rollplex_temporal=True,  # Video-R1's --temporal true: T-GRPO (docs/temporal.md)
    rollplex_len_control=True,  # Video-R1's --len_control true
)


@dataclass
class VideoR1Arguments:
    annotations: str = field(metadata={"help": "Video-R1-format annotation file (JSON list or JSON Lines)."})
    data_root: str | None = field(
        default=None, metadata={"help": "Folder that `./...` media paths are resolved against (default: the file's)."}
    )
    on_invalid: str = field(
        default="error",
        metadata={"help": "Invalid rows (unknown problem type, missing file, ...): raise, or drop and report them.",
                  "choices": ["error", "skip"]},
    )
    log_file: str | None = field(
        default=None, metadata={"help": "JSONL file for every logged step (default: <output_dir>/logs.jsonl)."}
    )


def main(script_args, training_args, model_args) -> None:
    from trl import get_peft_config

    from rollplex_trl import RollplexGRPOTrainer
    from rollplex_trl.callbacks import JsonlLoggerCallback
    from rollplex_trl.data import accuracy_reward, format_reward, load_video_r1

    dataset = load_video_r1(script_args.annotations, script_args.data_root, on_invalid=script_args.on_invalid)

    model = model_args.model_name_or_path
    if model is None:
        from rollplex_trl.testing.checkpoints import get_checkpoint

        model = str(get_checkpoint("qwen2_5_vl", "tiny"))
        print(f"no --model_name_or_path: using the local tiny Qwen2.5-VL checkpoint {model}")
    training_args.model_init_kwargs = {
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }

    log_file = script_args.log_file or os.path.join(training_args.output_dir, "logs.jsonl")
    trainer = RollplexGRPOTrainer(
        model=model,
        reward_funcs=[accuracy_reward, format_reward],
        args=training_args,
        train_dataset=dataset,
        peft_config=get_peft_config(model_args),
        callbacks=[JsonlLoggerCallback(log_file, overwrite=not training_args.resume_from_checkpoint)],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    trainer.accelerator.print(f"Trained {trainer.state.global_step} steps on {len(dataset)} Video-R1 rows. "
                              f"Model: {training_args.output_dir} | logs: {log_file}")
    trainer.end()  # under `accelerate launch`: close the process group once every rank is done


def make_parser():
    from trl import ModelConfig, TrlParser

    from rollplex_trl import RollplexGRPOConfig

    parser = TrlParser((VideoR1Arguments, RollplexGRPOConfig, ModelConfig))
    parser.set_defaults(**VIDEO_R1_DEFAULTS)
    return parser


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
