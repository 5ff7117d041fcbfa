"""Model architectures (from each model's Hugging Face ``config.json``) and their shapes.

Everything a cost model needs is derived here: the GEMM shapes one rank runs under tensor
parallelism, weight bytes per GPU, and KV-cache bytes per token. Weights and KV are bf16.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prorsa.errors import ConfigError

BYTES_BF16 = 2


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer; MoE when ``num_experts > 0``."""

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (0 for an all-MoE model)
    vocab_size: int
    tie_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ---- tensor parallelism -------------------------------------------------------
    def supports_tp(self, tp: int) -> bool:
        """vLLM's rule: query heads split evenly; KV heads split or are replicated."""
        kv = self.num_kv_heads
        return (
            tp >= 1
            and self.num_heads % tp == 0
            and (kv % tp == 0 or tp % kv == 0)
            and (not self.is_moe or self.moe_intermediate_size % tp == 0)
            and self.intermediate_size % tp == 0
        )

    def check_tp(self, tp: int) -> None:
        if not self.supports_tp(tp):
            raise ConfigError(
                f"model '{self.name}' cannot run with tp={tp}",
                hint=f"{self.num_heads} query and {self.num_kv_heads} KV heads must split "
                "evenly (KV heads may be replicated when tp is a multiple of them)",
            )

    def heads_per_rank(self, tp: int) -> int:
        return self.num_heads // tp

    def kv_heads_per_rank(self, tp: int) -> int:
        # vLLM replicates KV heads when tp exceeds their number
        return max(1, self.num_kv_heads // tp)

    # ---- shapes -------------------------------------------------------------------
    def layer_gemms(self, tp: int = 1) -> list[tuple[str, int, int, int]]:
        """``(name, n, k, count)`` of one layer's GEMMs on one rank (``m`` = tokens).

        Fused as vLLM runs them: QKV in one GEMM, gate and up in one GEMM. For an MoE
        model the expert GEMMs are listed per expert with ``count`` = experts per token,
        which is exact in FLOPs; weight reads are handled by the caller.
        """
        hd = self.head_dim
        qkv_n = (self.heads_per_rank(tp) + 2 * self.kv_heads_per_rank(tp)) * hd
        gemms = [
            ("qkv_proj", qkv_n, self.hidden_size, 1),
            ("o_proj", self.hidden_size, self.heads_per_rank(tp) * hd, 1),
        ]
        if self.intermediate_size:
            inter = self.intermediate_size // tp
            gemms += [
                ("gate_up_proj", 2 * inter, self.hidden_size, 1),
                ("down_proj", self.hidden_size, inter, 1),
            ]
        if self.is_moe:
            inter = self.moe_intermediate_size // tp
            gemms += [
                ("router", self.num_experts, self.hidden_size, 1),
                ("expert_gate_up", 2 * inter, self.hidden_size, self.experts_per_token),
                ("expert_down", self.hidden_size, inter, self.experts_per_token),
            ]
        return gemms

    def lm_head_gemm(self, tp: int = 1) -> tuple[int, int]:
        """``(n, k)`` of the vocab-parallel lm_head on one rank."""
        return -(-self.vocab_size // tp), self.hidden_size

    # ---- parameters and bytes -----------------------------------------------------
    def attention_params_per_layer(self, tp: int = 1) -> int:
        """Attention weights one rank holds per layer (KV projections replicated if needed)."""
        hd = self.head_dim
        qkv = self.hidden_size * (self.heads_per_rank(tp) + 2 * self.kv_heads_per_rank(tp)) * hd
        return qkv + self.heads_per_rank(tp) * hd * self.hidden_size

    def dense_mlp_params_per_layer(self, tp: int = 1) -> int:
        return 3 * self.hidden_size * (self.intermediate_size // tp)

    def expert_params(self, tp: int = 1) -> int:
        """One expert's weights on one rank (0 for dense models)."""
        if not self.is_moe:
            return 0
        return 3 * self.hidden_size * (self.moe_intermediate_size // tp)

    def layer_params(self, tp: int = 1) -> int:
        router = self.num_experts * self.hidden_size if self.is_moe else 0
        return (
            self.attention_params_per_layer(tp)
            + self.dense_mlp_params_per_layer(tp)
            + self.num_experts * self.expert_params(tp)
            + router
        )

    def active_layer_params(self, tp: int = 1) -> int:
        """Weights one token touches per layer on one rank (top-k experts for MoE)."""
        router = self.num_experts * self.hidden_size if self.is_moe else 0
        return (
            self.attention_params_per_layer(tp)
            + self.dense_mlp_params_per_layer(tp)
            + self.experts_per_token * self.expert_params(tp)
            + router
        )

    def embedding_params(self, tp: int = 1) -> int:
        """Embedding plus lm_head on one rank (both vocab-parallel; shared when tied)."""
        one = -(-self.vocab_size // tp) * self.hidden_size
        return one if self.tie_embeddings else 2 * one

    def total_params(self) -> int:
        return self.num_layers * self.layer_params(1) + self.embedding_params(1)

    def weight_bytes_per_gpu(self, tp: int = 1) -> int:
        return BYTES_BF16 * (self.num_layers * self.layer_params(tp) + self.embedding_params(tp))

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of every layer for one token on one rank, bf16."""
        return 2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * BYTES_BF16

    def to_dict(self) -> dict:
        return asdict(self)


MODELS: dict[str, ModelArch] = {
    m.name: m
    for m in (
        ModelArch(
            name="llama-3-8b",
            hf_id="meta-llama/Meta-Llama-3-8B",
            num_layers=32,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
        ),
        ModelArch(
            name="qwen2.5-7b",
            hf_id="Qwen/Qwen2.5-7B-Instruct",
            num_layers=28,
            hidden_size=3584,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=18944,
            vocab_size=152064,
        ),
        ModelArch(
            name="qwen2.5-32b",
            hf_id="Qwen/Qwen2.5-32B-Instruct",
            num_layers=64,
            hidden_size=5120,
            num_heads=40,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=27648,
            vocab_size=152064,
        ),
        # MoE: 128 experts, 8 routed per token, no shared expert; every layer is MoE.
        ModelArch(
            name="qwen3-30b-a3b",
            hf_id="Qwen/Qwen3-30B-A3B",
            num_layers=48,
            hidden_size=2048,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=0,
            vocab_size=151936,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=768,
        ),
        # MoE: 128 experts, 8 routed per token, no shared expert; 94 layers, all MoE.
        ModelArch(
            name="qwen3-235b-a22b",
            hf_id="Qwen/Qwen3-235B-A22B",
            num_layers=94,
            hidden_size=4096,
            num_heads=64,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=0,
            vocab_size=151936,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=1536,
        ),
    )
}


def get_model(name: str) -> ModelArch:
    """Return the architecture of model ``name``."""
    try:
        return MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model '{name}'", hint=f"choose one of: {', '.join(sorted(MODELS))}"
        ) from None


def model_config_dir():
    """``datasets/model_configs``: each model's Hugging Face ``config.json`` (shape fields)."""
    from prorsa.runtime.sim.cost.kernel_tables import repo_root

    return repo_root() / "datasets" / "model_configs"


def arch_from_hf_config(name: str, config: dict) -> ModelArch:
    """Build a :class:`ModelArch` from a Hugging Face ``config.json`` dict.

    Reads the fields Llama, Qwen2 and Qwen3-MoE configs share; ``head_dim`` defaults to
    ``hidden_size / num_attention_heads``. A Qwen3-MoE model whose every layer is sparse
    (``decoder_sparse_step == 1``, no ``mlp_only_layers``) has no dense MLP.
    """
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        experts = int(config.get("num_experts", 0) or 0)
        all_sparse = (
            experts > 0
            and int(config.get("decoder_sparse_step", 1)) == 1
            and not config.get("mlp_only_layers")
        )
        return ModelArch(
            name=name,
            hf_id=str(config.get("_name_or_path", name)),
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=0 if all_sparse else int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            num_experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size", 0) or 0),
        )
    except KeyError as exc:
        raise ConfigError(
            f"model config '{name}': missing field {exc.args[0]!r}",
            hint="a Hugging Face config.json with hidden_size, num_hidden_layers, "
            "num_attention_heads, intermediate_size and vocab_size",
        ) from None
