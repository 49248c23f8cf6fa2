"""rollplex-trl: faster GRPO post-training of vision-language models (Qwen2.5-VL on video) for TRL.

Change one line of a TRL script, `GRPOTrainer` -> `RollplexGRPOTrainer`, and train on video too.
"""

from rollplex_trl.config import RollplexGRPOConfig
from rollplex_trl.trainers.grpo import RollplexGRPOTrainer

__all__ = ["RollplexGRPOConfig", "RollplexGRPOTrainer"]
__version__ = "0.1.0"
