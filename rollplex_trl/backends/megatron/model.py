"""The policy as Megatron-Core: the LLM as a tensor-parallel ``GPTModel``, the HF vision tower replicated.

Built from a loaded HF model (``Qwen2_5_VLForConditionalGeneration`` or ``Qwen2ForCausalLM``) whose LLM weights are
copied into megatron-core's parallel layers through the layout algebra; the vision tower and merger are the HF
module itself, trained in place on every TP rank (Megatron-Bridge's convention). The forward reproduces the HF
model's own forward on TRL's batches: left-padded prompts, right-padded completions, a 2-D attention mask, vision
features scattered into the image/video token positions, M-RoPE positions from the HF model's ``get_rope_index``.
Logits stay vocabulary-parallel (``[B, L, V/t]``); :meth:`MegatronPolicy.token_logps` reduces them without a gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import rollplex_trl.megatron_compat as compat
from rollplex_trl.backends.megatron import weights
from rollplex_trl.backends.megatron.logprobs import vocab_parallel_logps
from rollplex_trl.backends.megatron.parallel import ParallelGroups
from rollplex_trl.backends.megatron.vision_split import VisionSplit, split_vision_features
from rollplex_trl.models.families import megatron_refusal


def _check_splits(text, t: int, where: str) -> None:
    for field in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        value = getattr(text, field)
        if field == "num_key_value_heads" and value < t and t % value == 0:
            continue  # fewer KV groups than ranks: Megatron replicates them (tp % groups == 0)
        if value % t:
            raise ValueError(f"rollplex_tensor_parallel_size={t} does not divide the model's {field}={value} "
                             f"({where}{field}); choose a tensor parallel size that divides it")


def _rope_settings(text) -> tuple[float, list[int] | None]:
    rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise NotImplementedError(f"rope_type={kind!r} (config.rope_parameters) is not supported by the Megatron "
                                  "backend; only the default RoPE / M-RoPE of Qwen2 and Qwen2.5-VL")
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    return float(theta), rope.get("mrope_section")


def transformer_config(text, t: int, dtype: torch.dtype, mrope_section: list[int] | None):
    """Qwen2's decoder in megatron-core terms (QKV bias, RMSNorm, SwiGLU, GQA), dropout 0."""
    from megatron.core.transformer import TransformerConfig

    if getattr(text, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={text.hidden_act!r} (config.hidden_act): only SwiGLU (silu) is mapped")
    if getattr(text, "use_sliding_window", False):
        raise NotImplementedError("use_sliding_window=True (config.use_sliding_window) is not supported")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return TransformerConfig(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_key_value_heads, kv_channels=head_dim, ffn_hidden_size=text.intermediate_size,
        add_bias_linear=False, add_qkv_bias=True, normalization="RMSNorm", layernorm_epsilon=text.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, tensor_model_parallel_size=t, sequence_parallel=False,
        # perform_initialization=True although the weights are overwritten: megatron-core 0.16 sets the
        # tensor_model_parallel attributes of its weights only inside its init functions (grad-norm clipping and
        # megatron's own tools read them).
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=True,
        mrope_section=list(mrope_section) if mrope_section else None)


class MegatronPolicy(nn.Module):
    """``gpt``: megatron-core's GPTModel (TP-sharded LLM); ``visual``: the HF vision tower + merger (or None)."""

    def __init__(self, hf_model: nn.Module, groups: ParallelGroups):
        super().__init__()
        refusal = megatron_refusal(hf_model.config)
        if refusal is not None:
            raise NotImplementedError(refusal)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        compat.apply_cpu_shims()
        config = hf_model.config
        self.groups = groups
        self.is_vl = getattr(config, "model_type", "") == "qwen2_5_vl"
        text = config.get_text_config()
        t = groups.tp_size
        _check_splits(text, t, "config.text_config." if text is not config else "config.")
        theta, mrope_section = _rope_settings(text)
        if self.is_vl:
            mrope_section = mrope_section or [16, 24, 24]  # HF's default in Qwen2_5_VLRotaryEmbedding
        embed = hf_model.get_input_embeddings().weight
        self.tied = hf_model.get_output_embeddings().weight is embed
        self.vocab_size = text.vocab_size
        tconfig = transformer_config(text, t, embed.dtype, mrope_section if self.is_vl else None)
        from rollplex_trl.backends.megatron.prefix import PrefixCoreAttention

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        # DotProductAttention with a K/V hook for the shared prefix (prefix.py); inert outside a prefix/suffix pass
        spec.submodules.self_attention.submodules.core_attention = PrefixCoreAttention
        self.gpt = GPTModel(tconfig, spec, vocab_size=text.vocab_size,
                            max_sequence_length=text.max_position_embeddings, parallel_output=True,
                            share_embeddings_and_output_weights=self.tied,
                            position_embedding_type="mrope" if self.is_vl else "rope", rotary_base=theta)
        # megatron's torch RMSNorm fallback (no Apex) creates fp32 weights whatever params_dtype is; the HF model's
        # norms are in its dtype, and keeping the HF dtypes keeps the optimizer's arithmetic the HF backend's.
        self.gpt.to(dtype=embed.dtype)
        # The HF backbone is kept (unregistered) for its get_rope_index, which reads only its config.
        object.__setattr__(self, "_backbone", hf_model.model if self.is_vl else None)
        self.visual = hf_model.model.visual if self.is_vl else None
        # set by the trainer (rollplex_split_vision): the tower's items spread over the TP ranks (vision_split.py)
        self.vision_split: VisionSplit | None = None
        self.image_token_id = getattr(config, "image_token_id", None)
        self.video_token_id = getattr(config, "video_token_id", None)

        self.options = weights.sharding_options(t)
        self.spec = weights.llm_spec(config)
        hf_params = dict(hf_model.named_parameters())
        self._hf_shapes = {n: p.shape for n, p in hf_params.items()}
        self._hf_dtypes = {n: p.dtype for n, p in hf_params.items()}
        self._load(weights.megatron_state(self.spec, self.options, groups.tp_rank, hf_params))
        # rows of a sharded parameter that a lower TP rank holds too (KV groups replicated over ranks): the global
        # grad norm counts them once (`clip_grad_norm_tensor_parallel(duplicate_rows=)`)
        self.duplicate_rows: dict[nn.Parameter, torch.Tensor] = {
            self.gpt.get_parameter(name): torch.as_tensor(dup)
            for name, dup in weights.duplicate_rows(self.spec, self.options, groups.tp_rank).items()}

    # ---------------------------------------------------------------------------------------------- weights
    @torch.no_grad()
    def _load(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.gpt.named_parameters())
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        if missing or extra:
            raise RuntimeError(f"GPTModel parameters without an HF value: {missing[:5]}; layout tensors without a "
                               f"GPTModel parameter: {extra[:5]}")
        for name, p in params.items():
            value = state[name]
            if value.numel() != p.numel():
                raise RuntimeError(f"{name}: GPTModel shape {tuple(p.shape)} vs layout shape {tuple(value.shape)}")
            p.copy_(value.reshape(p.shape))

    def iter_hf_state(self, include_visual: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, tensor)`` for every weight, in HF shapes and dtypes: the LLM unsharded one all-gather bucket
        at a time (every TP rank must consume the whole iterator), then the vision tower's own parameters."""
        params = {n: p.detach() for n, p in self.gpt.named_parameters()}
        for name, value in weights.iter_hf_llm_state(self.spec, self.options, params, self.groups.tp_group,
                                                     self._hf_shapes):
            yield name, value.to(self._hf_dtypes[name])
        if self.visual is not None and include_visual:
            for name, p in self.visual.named_parameters():
                yield f"model.visual.{name}", p.detach()

    def hf_state_dict(self, include_visual: bool = True) -> dict[str, torch.Tensor]:
        """The policy's weights in HF names, shapes and dtypes (the LLM all-gathered over TP, plus the vision
        tower); the same on every rank. Fresh copies (a collective: call it on every TP rank)."""
        return {name: value.clone() for name, value in self.iter_hf_state(include_visual)}

    @torch.no_grad()
    def copy_into_hf(self, hf_model: nn.Module) -> int:
        """Write the policy's weights into ``hf_model`` in place (the rollout engine's copy-path weight sync) and
        return the bytes copied; streamed bucket by bucket, never the whole model at once. The vision tower is
        skipped when ``hf_model`` owns this very module. A collective: call it on every TP rank."""
        shares_visual = getattr(getattr(hf_model, "model", None), "visual", None) is self.visual
        target = dict(hf_model.named_parameters())
        copied = 0
        for name, value in self.iter_hf_state(include_visual=not shares_visual):
            p = target[name]
            p.copy_(value.view_as(p))
            copied += p.numel() * p.element_size()
        return copied

    # ---------------------------------------------------------------------------------------------- forward
    def _positions(self, input_ids, attention_mask, mm_token_type_ids, image_grid_thw, video_grid_thw,
                   second_per_grid_ts) -> torch.Tensor | None:
        """M-RoPE positions exactly as Qwen2_5_VLModel.compute_3d_position_ids gives them (arange on all three axes
        when it cannot compute them); None for 1-D RoPE, where GPTModel uses arange(L) as HF does."""
        if not self.is_vl:
            return None
        B, L = input_ids.shape
        if mm_token_type_ids is not None and (image_grid_thw is not None or video_grid_thw is not None):
            positions, _ = self._backbone.get_rope_index(
                input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                second_per_grid_ts=second_per_grid_ts, attention_mask=attention_mask)
            return positions
        return torch.arange(L, device=input_ids.device).expand(3, B, L)

    def _embed(self, input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw) -> torch.Tensor:
        """Word embeddings (vocab-parallel) with the vision features scattered in as HF's forward does; [L, B, H].

        The features come from ``self.visual`` (not the HF backbone's tower), so a caller may swap in its own
        copy of the tower and its gradients land there."""
        embeds = self.gpt.embedding(input_ids=input_ids, position_ids=None).transpose(0, 1)  # [B, L, H]
        for pixels, grid, token_id in ((pixel_values, image_grid_thw, self.image_token_id),
                                       (pixel_values_videos, video_grid_thw, self.video_token_id)):
            if pixels is None:
                continue
            if self.vision_split is not None:  # this rank's items only, the features gathered over TP
                feats = split_vision_features(self.visual, pixels, grid, self.vision_split, dtype=embeds.dtype,
                                              hidden=embeds.shape[-1])
            else:
                # = Qwen2_5_VLModel.get_image_features / get_video_features, then torch.cat of their per-item split
                feats = self.visual(pixels.type(self.visual.dtype), grid_thw=grid).pooler_output
            feats = feats.to(embeds.device, embeds.dtype)
            mask = (input_ids == token_id).unsqueeze(-1)
            if int(mask.sum()) * embeds.shape[-1] != feats.numel():
                raise ValueError(f"vision features and placeholder tokens do not match: {int(mask.sum())} "
                                 f"tokens (id {token_id}), {feats.shape[0]} features")
            embeds = embeds.masked_scatter(mask.expand_as(embeds), feats)
        return embeds.transpose(0, 1).contiguous()

    @staticmethod
    def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
        """Causal + key padding as megatron wants it: [B, 1, L, L] booleans, True = masked."""
        L = attention_mask.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=attention_mask.device).triu(1)
        return causal[None, None] | (attention_mask == 0)[:, None, None, :]

    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                       pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                       pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                       second_per_grid_ts: torch.Tensor | None = None,
                       mm_token_type_ids: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Vocabulary-parallel logits ``[B, L, V/t]`` (the last ``logits_to_keep`` positions when > 0, like HF)."""
        if not self.is_vl and any(x is not None for x in (pixel_values, pixel_values_videos)):
            raise ValueError("vision inputs given to a text-only model")
        positions = self._positions(input_ids, attention_mask, mm_token_type_ids, image_grid_thw, video_grid_thw,
                                    second_per_grid_ts)
        embeds = self._embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        with self._keep_last(logits_to_keep):
            return self.gpt(input_ids=input_ids, position_ids=positions,
                            attention_mask=self.attention_mask_4d(attention_mask), decoder_input=embeds)

    @contextlib.contextmanager
    def _keep_last(self, keep: int):
        """Run the output layer on the last ``keep`` positions only (hidden states are [L, B, H] there)."""
        if not keep:
            yield
            return

        def hook(_module, args, kwargs):
            return (args[0][-keep:], *args[1:]), kwargs

        handle = self.gpt.output_layer.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def token_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *,
                    temperature: float = 1.0, compute_entropy: bool = False, **vision
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """TRL's ``_get_per_token_logps_and_entropies`` on one batch: the logits of positions ``[-K-1:-1]`` predict
        ``input_ids[:, -K:]``, divided by ``temperature``; returns fp32 ``[B, K]`` log-probs (and entropies)."""
        K = logits_to_keep
        logits = self.forward_logits(input_ids, attention_mask, logits_to_keep=K + 1, **vision)[:, :-1]
        return vocab_parallel_logps(logits, input_ids[:, -K:], temperature=temperature,
                                    tp_group=self.groups.tp_group, compute_entropy=compute_entropy)
