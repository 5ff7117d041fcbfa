"""A tiny random-initialised Llama and a locally trained tokenizer, for tests and demos.

Nothing is downloaded: the weights come from a seeded generator and the tokenizer is a
byte-level BPE trained on a small built-in corpus, so ``AutoTokenizer`` and vLLM load the
folder with ``HF_HUB_OFFLINE=1``. The same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from prorsa.errors import ConfigError

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

#: A plain chat template (role, colon, content), so chat endpoints can render messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + ': ' + message['content'] + '</s>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant: ' }}{% endif %}"
)

# A few lines of agent-like text: enough merges for a vocabulary of a few hundred tokens.
_CORPUS = (
    "The agent reads the repository, runs the tests, and edits the failing function.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Observation: 3 tests passed, 1 failed. Action: open src/main.py line 42.",
    "Thought: the tool returned an error, so I will retry with a smaller input.",
    "import os\nimport sys\nfor path in sys.argv[1:]:\n    print(os.path.getsize(path))",
    "User: solve 17 * 23 with the calculator. Assistant: calling calculator(17*23) = 391.",
    "Prefill reads the whole context; decode writes one token at a time.",
    '{"tool": "bash", "args": {"cmd": "ls -la"}, "result": "total 12"}',
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
    "Rollout workers generate trajectories while the trainer updates the policy.",
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model.

    Attributes:
        vocab_size: tokenizer vocabulary size (BPE merges stop here); also the embedding rows.
        hidden_size: model width.
        num_layers: decoder layers.
        num_heads: attention heads; ``head_dim = hidden_size // num_heads``.
        num_kv_heads: key/value heads (grouped-query attention when below ``num_heads``).
        intermediate_size: MLP width.
        max_position_embeddings: longest context the model accepts.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 4096

    def validate(self) -> None:
        if self.vocab_size < 300:
            raise ConfigError(
                f"vocab_size must be >= 300 (256 byte tokens + specials), got {self.vocab_size}"
            )
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "hidden_size must divide by num_heads and num_heads by num_kv_heads",
                hint=f"got hidden={self.hidden_size}, heads={self.num_heads}, "
                f"kv_heads={self.num_kv_heads}",
            )
        if self.max_position_embeddings < 2048:
            raise ConfigError("max_position_embeddings must be >= 2048")


def train_tokenizer(vocab_size: int) -> object:
    """Train a deterministic byte-level BPE tokenizer on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so pair counts are well separated and merges do not hinge on ties.
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    return tokenizer


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    spec: TinyModelSpec | None = None,
) -> Path:
    """Write a random-initialised Llama (float32 safetensors) and its tokenizer to ``out_dir``.

    Args:
        out_dir: folder to create (files in it are overwritten).
        seed: seeds the weight initialisation; same seed, identical files.
        spec: model shape; :class:`TinyModelSpec` defaults when omitted.

    Returns:
        The folder, ready for ``AutoTokenizer.from_pretrained`` and ``vllm``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = spec or TinyModelSpec()
    spec.validate()
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create model folder {out}: {exc.strerror}", hint="choose a writable folder"
        ) from None

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=spec.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _write_json(out / "prorsa_tiny_model.json", {"seed": seed, **spec.__dict__})
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
