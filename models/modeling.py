"""The generic ttr decoder: ``TTRModel`` and ``TTRForCausalLM``.

Block ``i`` = ``x + mixer_i(RMSNorm(x))`` then, when ``intermediate_size > 0``,
``x + SwiGLU(RMSNorm(x))`` (pre-norm residual blocks as in Transformer++, Touvron et al. 2023,
arXiv:2302.13971). The mixer class comes from ``layer_types[i]`` via ``LAYER_TYPES``. Each
residual add is taken by the norm that follows it (the next block's, or the final one), which
adds and normalises in one kernel each way; so a block hands on ``(x, branch)`` with its last
add still to do.

Padding, packing and positions are resolved once here and handed to every layer:

* ``attention_mask`` (2-D, covering the cached and the new positions) -> ``full_mask`` (for
  attention over cached keys) and ``mask`` (the new positions; linear mixers zero k/v/beta and
  the decay there, so padding never touches a state).
* ``cu_seqlens`` (B == 1), or derived from ``position_ids`` that restart at 0, keeps documents
  apart in every kernel; rotary positions restart per document. It becomes one
  ``ttr.kernels.Packing`` per forward (``packing_of``), which every layer hands to its kernels,
  so the offsets are checked and indexed once rather than by every op. Offsets given on the CPU
  (as the trainer's batches have them) then cost the forward no wait for the GPU; offsets on the
  GPU, or ``position_ids`` on it, are read to the host once, here.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from ttr.kernels.common.index import Packing, prepare_packing
from ttr.kernels.loss import linear_cross_entropy

from .cache import TTRCache
from .configuration import TTRConfig
from .layers import LAYER_TYPES
from .modules import GatedRMSNorm, RMSNorm, ShortConv, SwiGLU
from .remote_code import SavesRemoteCode


class TTRBlock(GradientCheckpointingLayer):
    def __init__(self, config: TTRConfig, layer_idx: int):
        super().__init__()
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = LAYER_TYPES[config.layer_types[layer_idx]](config, layer_idx)
        if config.intermediate_size > 0:
            self.mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        else:
            self.mlp_norm = self.mlp = None

    def forward(
        self,
        hidden_states,
        branch=None,
        mask=None,
        full_mask=None,
        cu_seqlens=None,
        position_ids=None,
        past_key_values=None,
    ):
        """Returns ``(residual, branch)``: the block's output is ``residual + branch``. The last
        add is left to the next norm, which takes it in the same kernel (``RMSNorm(x, branch)``);
        ``branch`` in is the previous block's pending add (None before the first block)."""
        hidden_states, normed = norm_after_add(self.mixer_norm, hidden_states, branch)
        branch = self.mixer(
            normed,
            mask=mask,
            full_mask=full_mask,
            cu_seqlens=cu_seqlens,
            position_ids=position_ids,
            cache=past_key_values,
        )
        if self.mlp is not None:
            hidden_states, normed = self.mlp_norm(hidden_states, branch)
            branch = self.mlp(normed)
        return hidden_states, branch


def norm_after_add(norm: RMSNorm, hidden: torch.Tensor, branch: torch.Tensor | None):
    """``(hidden + branch, norm(hidden + branch))``, or ``(hidden, norm(hidden))`` without a branch."""
    if branch is None:
        return hidden, norm(hidden)
    return norm(hidden, branch)


class TTRPreTrainedModel(SavesRemoteCode, PreTrainedModel):
    config_class = TTRConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TTRBlock"]
    _is_stateful = True

    def _init_weights(self, module: nn.Module) -> None:
        """Initialise ``module`` by ``config.initializer_scheme``.

        ``"reference"`` follows the reference implementation of each family: fla 0.6.0 (GLA,
        DeltaNet, Gated DeltaNet) and HF Llama (attention, SwiGLU) draw every matrix, short convs
        included (fla's short conv is an ``nn.Conv1d``), from N(0, ``initializer_range``) with no
        depth scaling; Mamba2 layers re-initialise their own projections and conv as mamba_ssm
        does (``Mamba2.init_mixer_weights``). ``"depth_scaled"`` scales the residual output
        projections by 1/sqrt(number of residual branches) so the residual stream's variance does
        not grow with depth (GPT-2, Radford et al. 2019) and keeps nn.Conv1d's uniform conv init.
        Mixer parameters beyond matrices (decays, time steps) come from ``init_mixer_weights``.
        """
        cfg = self.config
        std = cfg.initializer_range
        reference = cfg.initializer_scheme == "reference"
        if isinstance(module, nn.Linear):
            if not reference and getattr(module, "_residual_out", False):
                std = std / math.sqrt(cfg.num_hidden_layers * (2 if cfg.intermediate_size > 0 else 1))
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, ShortConv):
            if reference:
                init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    init.zeros_(module.bias)
            else:
                module.init_conv_weights(init)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            init.ones_(module.weight)
        if hasattr(module, "init_mixer_weights"):
            module.init_mixer_weights(init)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document boundaries (int32, on the CPU) where ``position_ids`` (``[1, T]``) restart at 0, or
    None without restarts. Positions on a GPU are read to the host: the one wait of a forward whose
    packing comes from positions."""
    pos = position_ids[0].detach().cpu()
    starts = (pos[1:] == 0).nonzero().squeeze(-1) + 1
    if starts.numel() == 0:
        return None
    return torch.cat([starts.new_zeros(1), starts, starts.new_tensor([pos.numel()])]).to(torch.int32)


# transformers 5.24 renamed the cache argument and output field ``past_key_values`` to ``cache``
# (``generate`` passes ``cache=``; the old name still works there, with a deprecation warning). The
# model takes either name and fills the output field of the installed version.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_argument(past_key_values, kwargs: dict):
    """The cache passed as ``past_key_values`` or as ``cache`` (popped from ``kwargs``); both is an error."""
    cache = kwargs.pop("cache", None)
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the cache once: as past_key_values or as cache, not both")
    return past_key_values if cache is None else cache


def packing_of(cu_seqlens, position_ids, past_key_values, tokens: torch.Tensor) -> Packing | None:
    """The forward's ``Packing``: from ``cu_seqlens`` (a tensor or a ``Packing``), else from
    ``position_ids`` that restart at 0 in a single row without a cache; None when not packed.
    ``tokens`` (``[B, T]`` ids or ``[B, T, hidden]`` embeddings) gives T and the device."""
    if cu_seqlens is None and position_ids is not None and past_key_values is None:
        if tokens.shape[0] == 1 and position_ids.shape[0] == 1:
            cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    if cu_seqlens is None:
        return None
    return prepare_packing(cu_seqlens, tokens.shape[1], device=tokens.device)


def positions_in_documents(packing: Packing) -> torch.Tensor:
    """``[1, T]``: each token's position inside its document."""
    idx = torch.arange(packing.seqlen, device=packing.cu_seqlens.device)
    return (idx - packing.cu_seqlens.long()[packing.seq_ids.long()])[None]


def check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
    """Exactly one of the two, ``[B, T]`` ids or ``[B, T, hidden]`` embeddings, neither empty."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if inputs_embeds is None:
        name, given, shape = "input_ids", input_ids, "[B, T]"
    else:
        name, given, shape = "inputs_embeds", inputs_embeds, "[B, T, hidden]"
    if given.dim() != shape.count(",") + 1:
        raise ValueError(f"{name} must be {shape}, got shape {tuple(given.shape)}")
    if 0 in given.shape[:2]:
        raise ValueError(f"{name} is empty (shape {tuple(given.shape)}): need at least one row and position")


class TTRModel(TTRPreTrainedModel):
    def __init__(self, config: TTRConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TTRBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self._warned: set[str] = set()
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def _resolve_masks(self, attention_mask, b: int, t: int, seen: int):
        if attention_mask is None:
            return None, None
        if attention_mask.dim() != 2 or attention_mask.shape[0] != b or attention_mask.shape[1] != seen + t:
            raise ValueError(
                f"attention_mask must be 2-D [B, cached + new] = [{b}, {seen + t}] (padding 0, tokens 1), "
                f"got {tuple(attention_mask.shape)}"
            )
        full_mask = attention_mask.bool()
        if bool(full_mask.all()):
            return None, None
        mask = full_mask[:, -t:]
        return (None if bool(mask.all()) else mask), full_mask

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def _check_trained_positions(self, position_ids: torch.Tensor, bound: int | None) -> None:
        """Warn once when a full-attention layer with rotary embeddings sees a position at or past
        ``max_position_embeddings``: rotary scores depend on query-key offsets, which then exceed
        any the configuration promises. Sliding-window layers are exempt (their offsets stay below
        the window), as are the linear mixers (no positions). ``bound`` is an upper bound on the
        positions when the model made them itself; it spares a device sync on short inputs."""
        cfg = self.config
        if "positions" in self._warned or cfg.rope_theta is None or "attn" not in cfg.layer_types:
            return
        limit = cfg.max_position_embeddings
        if bound is not None and bound <= limit:
            return
        last = int(position_ids.max())
        if last >= limit:
            self._warn_once(
                "positions",
                f"the input reaches position {last}, past max_position_embeddings={limit} of this "
                "model's rotary full-attention layers; outputs there are outside the configured range "
                "(warned once per model)",
            )

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: TTRCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Returns a tuple instead of the output object with ``return_dict=False`` (or
        ``config.return_dict=False``), as transformers models do. The cache may also come as
        ``cache=`` (transformers >= 5.24's name)."""
        past_key_values = cache_argument(past_key_values, kwargs)
        check_inputs(input_ids, inputs_embeds)
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        if output_attentions:
            self._warn_once(
                "attentions",
                "output_attentions=True: ttr's mixers compute no attention maps (linear mixers keep a "
                "state instead, and the attention kernels do not materialise the weights); the "
                "output's attentions stay None",
            )
        hidden = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = hidden.shape[:2]
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if self.gradient_checkpointing and self.training:
            use_cache = False
        cu_seqlens = packing_of(cu_seqlens, position_ids, past_key_values, hidden)
        if cu_seqlens is not None:
            if past_key_values is not None:
                raise ValueError("cu_seqlens (packed documents) cannot be combined with past_key_values")
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                raise ValueError(
                    "attention_mask with padding cannot be combined with cu_seqlens; pack instead"
                )
            attention_mask, use_cache = None, False
        if past_key_values is not None and not isinstance(past_key_values, TTRCache):
            raise TypeError(f"past_key_values must be a TTRCache, got {type(past_key_values).__name__}")
        if use_cache and past_key_values is None:
            past_key_values = TTRCache(self.config.num_hidden_layers)
        # A cache passed in is always continued (and updated), even with use_cache=False.
        cache = past_key_values if use_cache or past_key_values is not None else None
        seen = cache.seen_tokens if cache is not None else 0
        mask, full_mask = self._resolve_masks(attention_mask, b, t, seen)
        bound = None if position_ids is not None else seen + t
        if position_ids is None:
            if cu_seqlens is not None:
                position_ids = positions_in_documents(cu_seqlens)
            elif full_mask is not None:
                position_ids = (full_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
            else:
                position_ids = torch.arange(seen, seen + t, device=hidden.device)[None].expand(b, t)
        self._check_trained_positions(position_ids, bound)
        all_hidden = [] if output_hidden_states else None
        branch = None
        for layer in self.layers:
            if all_hidden is not None:
                all_hidden.append(hidden if branch is None else hidden + branch)
            hidden, branch = layer(
                hidden,
                branch,
                mask=mask,
                full_mask=full_mask,
                cu_seqlens=cu_seqlens,
                position_ids=position_ids,
                past_key_values=cache,
            )
        hidden = norm_after_add(self.norm, hidden, branch)[1]
        if all_hidden is not None:
            all_hidden.append(hidden)
        if cache is not None:
            cache.seen_tokens += t
        return BaseModelOutputWithPast(
            last_hidden_state=hidden,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            **{CACHE_FIELD: cache},
        )


class LMHead(nn.Linear):
    """The output projection. Given ``targets`` it returns the fused linear cross-entropy (summed
    or mean over non-ignored targets) instead of logits. The loss goes through the module's own
    forward rather than reading ``lm_head.weight`` from outside, so that wrappers which act on
    forward calls see it: under FSDP2 (accelerate puts the final norm and the head in one unit)
    the head's weight is only guaranteed gathered, and its gradient reduced, when it runs forward;
    reading the weight from outside gave an illegal memory access on 2 H200s."""

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"):
        if targets is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, targets, ignore_index=-100, reduction=reduction)

    @classmethod
    def adopt(cls, head: nn.Module) -> nn.Module:
        """Make a plain bias-free ``nn.Linear`` (what transformers builds when it resizes the
        vocabulary) an ``LMHead`` in place: same parameters, hooks and device, since the class adds
        no state. Any other module is returned as it is."""
        if type(head) is nn.Linear and head.bias is None:
            head.__class__ = cls
        return head


class TTRForCausalLM(TTRPreTrainedModel, GenerationMixin):
    """The decoder with its output head.

    Loss: with ``labels`` (HF convention: position t predicts ``labels[t + 1]``; -100 ignored;
    summed and divided by ``num_items_in_batch`` when given) and ``config.fuse_cross_entropy``, the
    head computes the fused linear cross-entropy, which never materialises the ``[B, T, vocab]``
    logits. In training the output's ``logits`` are then ``None``; in eval mode (``model.eval()``,
    as ``Trainer.evaluate`` / ``predict`` run it) the logits are computed and returned with the
    loss. ``return_logits=True`` / ``False`` asks for them / skips them in either mode. A head that
    is not an ``LMHead`` (for instance a PEFT wrapper around ``lm_head``) takes no targets; the
    loss then comes from its logits.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: TTRConfig):
        super().__init__(config)
        self.model = TTRModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = LMHead.adopt(new_embeddings)

    def _get_resized_lm_head(self, old_lm_head, *args, **kwargs):
        # Adopted here rather than only in set_output_embeddings: resize_token_embeddings attaches
        # accelerate's hooks to the new head in between, and they bind the class's forward.
        return LMHead.adopt(super()._get_resized_lm_head(old_lm_head, *args, **kwargs))

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The model builds its own TTRCache (recurrent + conv states, windowed KV).
        return False

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: TTRCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = True,
        logits_to_keep: int | None = None,
        next_sequence_length: int | None = None,
        **kwargs,
    ) -> dict:
        """The positions the cache has not consumed yet. A prompt given as ``inputs_embeds`` is
        consumed first; the ``input_ids`` transformers passes then hold only the generated tokens
        (empty at the start), so what is new is counted from the end: ``next_sequence_length``
        (transformers 5) or the 2-D ``attention_mask``, which spans cached and new positions.
        ``position_ids`` from ``generate`` are dropped: the model derives positions from the mask
        and the cache, and a row of generate's positions restarting at 0 would read as packing."""
        past_key_values = cache_argument(past_key_values, kwargs)
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        inputs = {
            CACHE_FIELD: past_key_values,
            "attention_mask": attention_mask,
            "use_cache": use_cache,
            "input_ids": None,
        }
        if inputs_embeds is not None and seen < inputs_embeds.shape[1]:
            inputs["inputs_embeds"] = inputs_embeds[:, seen:]
        else:
            if next_sequence_length is not None:
                new = next_sequence_length
            elif attention_mask is not None:
                new = attention_mask.shape[1] - seen
            else:
                new = input_ids.shape[1] - seen
            inputs["input_ids"] = input_ids[:, input_ids.shape[1] - new :].contiguous()
        if logits_to_keep is not None:
            inputs["logits_to_keep"] = logits_to_keep
        return inputs

    def _targets(self, labels, shape, packing: Packing | None):
        if labels.shape != shape:
            raise ValueError(f"labels must have shape [B, T] = {tuple(shape)}, got {tuple(labels.shape)}")
        # HF convention: labels are the inputs; position t predicts label t+1.
        targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        if packing is not None:
            # The last token of a document must not be trained to predict the next document.
            # (index_fill_ with a device index launches without reading it on the host, where
            # an advanced-indexing assignment synchronises). An empty first document ends at
            # -1, taken modulo T to the last token, whose target is -100 already.
            ends = (packing.cu_seqlens[1:].long() - 1) % targets.shape[1]
            targets[0].index_fill_(0, ends, -100)
        return targets.reshape(-1)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: TTRCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_logits: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``return_logits`` (only with ``labels``): also return the logits. Default: in eval mode
        yes, in training no when the loss is fused (see the class docstring). ``return_dict=False``
        returns a tuple instead of the output object. ``cu_seqlens`` may be a ``ttr.kernels.Packing``
        (``prepare_packing``), which the model then uses as it is."""
        past_key_values = cache_argument(past_key_values, kwargs)
        check_inputs(input_ids, inputs_embeds)
        cu_seqlens = packing_of(cu_seqlens, position_ids, past_key_values,
                                input_ids if input_ids is not None else inputs_embeds)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
        )
        hidden = outputs.last_hidden_state
        loss = logits = None
        fused = labels is not None and self.config.fuse_cross_entropy and isinstance(self.lm_head, LMHead)
        if return_logits is None:
            return_logits = not self.training
        if labels is None:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden[:, keep])
        elif return_logits or not fused:
            logits = self.lm_head(hidden)
        if labels is not None:
            targets = self._targets(labels, hidden.shape[:2], cu_seqlens)
            reduction = "mean" if num_items_in_batch is None else "sum"
            if logits is None:
                flat = hidden.reshape(-1, hidden.shape[-1])
                loss = self.lm_head(flat, targets=targets, reduction=reduction)
            else:
                loss = F.cross_entropy(
                    logits.flatten(0, 1).float(), targets, ignore_index=-100, reduction=reduction
                )
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )
