"""Tiny random transformers models, built from configs in the process (never downloaded).

Every builder seeds the RNG before building, so two fresh processes build the same
weights and the same inputs. Used by the family coverage suite, the decode test and
``benchmarks/families.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

VOCAB = 128


class Size:
    """Model widths and input shape. ``tiny`` for tests; ``small`` (as the GPT of
    benchmarks/models.py) makes eager's first call long enough to compare against."""

    def __init__(self, hidden: int, layers: int, heads: int, batch: int, seq: int) -> None:
        self.hidden, self.layers, self.heads, self.batch, self.seq = hidden, layers, heads, batch, seq


SIZES = {"tiny": Size(32, 2, 4, 2, 8), "small": Size(256, 4, 4, 2, 64)}


def _decoder(s: Size) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=s.hidden,
        intermediate_size=2 * s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads // 2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _llama(s: Size) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_decoder(s)))


def _qwen2(s: Size) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_decoder(s)))


def _mistral(s: Size) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_decoder(s), sliding_window=None))


def _mixtral(s: Size) -> Any:
    """MoE routing: top-2 of 4 experts per token."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**_decoder(s), num_local_experts=4, num_experts_per_tok=2,
                                            sliding_window=None))


def _mistral_sliding(s: Size) -> Any:
    """Sliding-window attention narrower than the input (window 4, seq 8)."""
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_decoder(s), sliding_window=max(2, s.seq // 2)))


def _phi3(s: Size) -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(**_decoder(s)))


def _gemma(s: Size) -> Any:
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(**_decoder(s), head_dim=s.hidden // s.heads))


def _qwen3(s: Size) -> Any:
    """Per-head q/k RMSNorm before RoPE."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_decoder(s), head_dim=s.hidden // s.heads))


def _qwen3_moe(s: Size) -> Any:
    """Sparse MoE blocks: top-2 of 4 experts, router logits normalized."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_decoder(s), head_dim=s.hidden // s.heads, num_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=s.hidden))


def _deepseek_v3(s: Size) -> Any:
    """Multi-head latent attention (low-rank q and kv, split RoPE dims), a dense first layer then
    MoE layers with a shared expert and grouped top-k routing."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    head = s.hidden // s.heads
    cfg = {**_decoder(s), "num_key_value_heads": s.heads}
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **cfg, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=s.hidden, first_k_dense_replace=1,
        kv_lora_rank=2 * head, q_lora_rank=2 * head, qk_rope_head_dim=head, qk_nope_head_dim=head, v_head_dim=head,
        head_dim=head, n_group=1, topk_group=1,
    ))


def _gemma3(s: Size) -> Any:
    """Local sliding-window layers between global ones, two RoPE bases, q/k norms, soft-capping."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**_decoder(s), head_dim=s.hidden // s.heads,
                                              sliding_window=max(2, s.seq // 2)))


def _gpt2(s: Size) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_embd=s.hidden, n_layer=s.layers, n_head=s.heads, n_positions=256,
                   bos_token_id=1, eos_token_id=2)
    )


def _gpt_neox(s: Size) -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        )
    )


def _opt(s: Size) -> Any:
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB, hidden_size=s.hidden, ffn_dim=2 * s.hidden, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, max_position_embeddings=256, word_embed_proj_dim=s.hidden,
            pad_token_id=1, bos_token_id=2, eos_token_id=2,
        )
    )


def _bert(s: Size) -> Any:
    from transformers import BertConfig, BertModel

    return BertModel(
        BertConfig(
            vocab_size=VOCAB, hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
            num_attention_heads=s.heads, max_position_embeddings=256,
        ),
        add_pooling_layer=False,
    )


def _t5_encoder(s: Size) -> Any:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=VOCAB, d_model=s.hidden, d_kv=s.hidden // s.heads, d_ff=2 * s.hidden, num_layers=s.layers,
            num_heads=s.heads, decoder_start_token_id=0,
        )
    )


#: family -> (builder, name of the output tensor compared with eager)
FAMILIES: dict[str, tuple[Callable[[Size], Any], str]] = {
    "llama": (_llama, "logits"),
    "qwen2": (_qwen2, "logits"),
    "mistral": (_mistral, "logits"),
    "mixtral": (_mixtral, "logits"),
    "mistral_sliding": (_mistral_sliding, "logits"),
    "phi3": (_phi3, "logits"),
    "gemma": (_gemma, "logits"),
    "qwen3": (_qwen3, "logits"),
    "qwen3_moe": (_qwen3_moe, "logits"),
    "deepseek_v3": (_deepseek_v3, "logits"),
    "gemma3": (_gemma3, "logits"),
    "gpt2": (_gpt2, "logits"),
    "gpt_neox": (_gpt_neox, "logits"),
    "opt": (_opt, "logits"),
    "bert": (_bert, "last_hidden_state"),
    "t5_encoder": (_t5_encoder, "last_hidden_state"),
}

def build(family: str, seed: int = 0, size: str = "tiny") -> tuple[Any, dict[str, torch.Tensor]]:
    """``(model.eval(), inputs)``: the same weights and inputs in every process.

    Inputs are keyword arguments, as users call models: ``input_ids`` and an
    ``attention_mask`` (all ones; the batch is unpadded)."""
    builder, _ = FAMILIES[family]
    s = SIZES[size]
    torch.manual_seed(seed)
    model = builder(s).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, VOCAB, (s.batch, s.seq), generator=gen)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def output_tensor(family: str, out: Any) -> torch.Tensor:
    """The tensor of ``out`` (a ModelOutput, or a tuple) compared with eager."""
    name = FAMILIES[family][1]
    return out[name] if not isinstance(out, tuple) else out[0]


# --------------------------------------------------------------------------- LLM decode

#: StaticCache capacity: prompt + decode steps must fit
MAX_CACHE_LEN = 64


def make_kv_cache(model: Any, kind: str) -> Any:
    """An empty transformers KV cache: ``"dynamic"`` (DynamicCache, grows by concatenation) or
    ``"static"`` (StaticCache, preallocated to MAX_CACHE_LEN, written in place)."""
    from transformers import DynamicCache, StaticCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=MAX_CACHE_LEN)
    raise ValueError(f"unknown KV cache kind {kind!r}: 'dynamic' or 'static'")


def prompt(length: int, seed: int = 3) -> torch.Tensor:
    """A batch-1 prompt of ``length`` token ids."""
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy_decode(
    forward: Callable[..., Any], model: Any, ids: torch.Tensor, kind: str, steps: int = 16,
    timings: list[float] | None = None,
):
    """Greedy generation as a serving loop writes it: a prefill call, then ``steps`` decode calls of
    one token each, the KV cache and the attention mask growing. ``forward`` is called as the
    model's forward is (keyword arguments, ``cache=``, ``use_cache=True``).

    Returns ``(tokens, logits)``: the ``steps + 1`` generated token ids and each call's last-position
    logits. ``timings``, if given, receives each call's seconds (prefill first), up to its token."""
    cache = make_kv_cache(model, kind)
    mask = torch.ones_like(ids)
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        out = forward(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        last = out.logits[:, -1]
        ids = last.argmax(-1, keepdim=True)
        tokens.append(int(ids.item()))
        if timings is not None:
            timings.append(time.perf_counter() - t0)
        logits.append(last.clone())
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return tokens, logits
