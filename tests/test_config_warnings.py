"""RollplexGRPOConfig() warns about nothing the user did not write: TRL's GRPOConfig defaults the deprecated
`gradient_checkpointing` to True and transformers then warns on every config; ours resolves the same way, quietly."""

import warnings

from trl import GRPOConfig

from rollplex_trl import RollplexGRPOConfig


def test_no_future_warning_for_trls_default_and_the_same_resolution(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trl = GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert any("gradient_checkpointing" in str(w.message) for w in caught)  # what TRL's own config does
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ours = RollplexGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert ours.activation_checkpointing == trl.activation_checkpointing is True
    assert ours.gradient_checkpointing == trl.gradient_checkpointing is True
    # an explicit value is the user's: resolved (and warned about) as transformers does
    for value in (False, True):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            trl = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=value)
            ours = RollplexGRPOConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=value)
        assert ours.activation_checkpointing == trl.activation_checkpointing == value
