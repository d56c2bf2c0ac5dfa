"""The built-in models peers can train, sized for 2-core CPUs but runnable on CUDA.

They span the cases decentralized training has to handle: a tiny MLP whose rounds are
compute-bound, a CNN, a wide MLP with millions of parameters where sending the model
over a slow link costs more than computing a step, and a small causal transformer.
`build_model` resolves names through an explicit table so configs cannot reach arbitrary code
(user models go through `trainers.datasets.load_factory` instead).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sized
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

DIGITS_FEATURES = 64
DIGITS_CLASSES = 10


def pick_device() -> torch.device:
    """CUDA when this machine has it, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class DigitsMLP(nn.Module):
    """64 -> hidden -> 10; the cheap model whose single-process accuracy is the regression baseline."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(DIGITS_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, DIGITS_CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitsCNN(nn.Module):
    """Two 3x3 convs and a pool over the 8x8 image; accepts (N, 64) or (N, 1, 8, 8) input."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * c * 4 * 4, 64), nn.ReLU(), nn.Linear(64, DIGITS_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, 1, 8, 8)))


class WideMLP(nn.Module):
    """64 -> width -> width -> 10: with width=1536 about 2.5 M parameters (9.9 MB in float32).

    Still a few seconds an epoch on digits on CPU, but big enough that shipping it over a slow
    link dominates a training round, which is what the slow-link benchmark needs.
    """

    def __init__(self, width: int = 1536) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(DIGITS_FEATURES, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, DIGITS_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention through torch's fused scaled_dot_product_attention, causal mask."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """Causal char-level language model: (batch, t <= block) ids -> (batch, t, vocab) logits.

    Embedding and output weights are deliberately not tied: tied weights appear twice in
    state_dict, and code that averages state dicts between peers would update them twice.
    """

    def __init__(
        self,
        vocab: int | Sized,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        block: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab if isinstance(vocab, int) else len(vocab)
        self.block = block
        self.tok = nn.Embedding(self.vocab_size, d_model)
        self.pos = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, self.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block:
            raise ValueError(f"sequence length {t} exceeds block size {self.block}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


LM_PRESETS: MappingProxyType[str, MappingProxyType[str, int]] = MappingProxyType({
    # GPT-2-small's width with 15 blocks: 106.6 M parameters at the corpus's 65 characters (GPT-2's own 124 M
    # holds 38.6 M in a 50,257-token embedding a character vocabulary does not need). Links bind on it: one
    # float32 copy is 426 MB, 34 s at 100 Mbit/s (issue 41).
    "lm_100m": MappingProxyType({"d_model": 768, "n_layers": 15, "n_heads": 12, "block": 256}),
    # Its small sibling, 14.3 M parameters, whose loss curves reach a target on a 2-core CPU.
    "lm_14m": MappingProxyType({"d_model": 384, "n_layers": 8, "n_heads": 6, "block": 128}),
})
"""Named sizes of `CharTransformer` on the shipped corpus, for training where the links bind; a preset's
`model_options` may still override any of its sizes."""

MODELS: MappingProxyType[str, Callable[..., nn.Module]] = MappingProxyType(
    {
        "digits_mlp": DigitsMLP,
        "digits_cnn": DigitsCNN,
        "digits_wide_mlp": WideMLP,
        "char_transformer": CharTransformer,
        **{name: functools.partial(CharTransformer, **sizes) for name, sizes in LM_PRESETS.items()},
    }
)


def build_model(name: str, **opts: object) -> nn.Module:
    """A fresh model by registry name; `opts` go to its constructor (char_transformer needs `vocab`)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}") from None
    try:
        inspect.signature(factory).bind(**opts)
    except TypeError as e:
        raise ValueError(f"bad options for model {name!r}: {e}") from None
    return factory(**opts)
