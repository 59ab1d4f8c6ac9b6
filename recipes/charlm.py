"""A small decoder-only transformer trained as a character-level language model on Python's own source.

The corpus is a fixed list of standard-library modules read at run time: present on every machine
with Python, nothing to download, and the same text for one Python version.

    trainer fit recipes/charlm.yaml
    trainer predict recipes/charlm.yaml ckpt_path=last

The model's top-level children are `embed`, `blocks` (an nn.Sequential) and `head`, so the pipeline
strategy can split it at `blocks.<i>`.
"""

from __future__ import annotations

import string
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchyard.recipes import check_loader_args, check_optimizer_args
from torchyard.trainer import DataModule, TrainModule
from torchyard.trainer.errors import MisconfigurationError

CORPUS_FILES = (
    "argparse.py", "calendar.py", "contextlib.py", "dataclasses.py", "difflib.py", "functools.py",
    "heapq.py", "queue.py", "random.py", "shutil.py", "string.py", "textwrap.py",
)

# A fixed alphabet (printable ASCII, tab, newline; anything else maps to UNKNOWN) rather than one
# collected from the corpus: a checkpoint then samples the same way on every Python version, and
# the model needs no size handed over from the data.
UNKNOWN = "\N{REPLACEMENT CHARACTER}"
ALPHABET = UNKNOWN + "\t\n" + "".join(ch for ch in string.printable if ch.isprintable())
VOCAB_SIZE = len(ALPHABET)
_INDEX = {ch: i for i, ch in enumerate(ALPHABET)}


def encode(text: str) -> torch.Tensor:
    """Characters to token ids (a 1-D long tensor)."""
    return torch.tensor([_INDEX.get(ch, 0) for ch in text], dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    return "".join(ALPHABET[int(t)] for t in tokens)


def read_corpus(files: Sequence[str]) -> str:
    """The named standard-library source files, concatenated."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    missing = [name for name in files if not (stdlib / name).is_file()]
    if missing:
        raise MisconfigurationError(f"corpus files {missing} are not in this Python's standard library ({stdlib}); "
                                    "list other files in data.init_args.files.")
    return "\n".join((stdlib / name).read_text(encoding="utf-8") for name in files)


# --------------------------------------------------------------------------- the model


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding."""

    def __init__(self, vocab_size: int, block_size: int, width: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.dropout(self.tokens(tokens) + self.positions(positions))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each around a residual connection."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class CharLM(TrainModule):
    """embed -> blocks -> head (final norm + linear), trained on next-character prediction."""

    def __init__(self, block_size: int = 128, width: int = 128, layers: int = 4, heads: int = 4, dropout: float = 0.0,
                 lr: float = 2e-3, weight_decay: float = 0.01, max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int | None = 20) -> None:
        super().__init__()
        check_optimizer_args(type(self).__name__, lr, weight_decay)
        if width % heads:
            raise MisconfigurationError(f"width={width} must be divisible by heads={heads}.")
        self.save_hyperparameters()
        self.embed = Embedding(VOCAB_SIZE, block_size, width, dropout)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, VOCAB_SIZE))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next character at every position: (batch, length, vocab)."""
        return self.head(self.blocks(self.embed(tokens)))

    def pipeline_input(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """What the first pipeline stage reads: the input characters."""
        return batch[0]

    def pipeline_loss(self, output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Next-character cross-entropy of the logits against the batch's targets (also the training loss)."""
        return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self(batch[0]), batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.pipeline_loss(self(batch[0]), batch), prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test/loss", self.pipeline_loss(self(batch[0]), batch))

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> list[str]:
        """Each prompt in the batch followed by a sampled continuation, as text."""
        return [decode(row) for row in self.generate(batch, self.hparams.max_new_tokens)]

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Append `new_tokens` sampled characters to each row of `tokens`."""
        block_size, temperature, top_k = self.hparams.block_size, self.hparams.temperature, self.hparams.top_k
        for _ in range(new_tokens):
            logits = self(tokens[:, -block_size:])[:, -1] / max(temperature, 1e-5)
            if top_k:
                kth_best = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth_best, float("-inf"))
            next_token = torch.multinomial(logits.softmax(dim=-1), num_samples=1)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # No weight decay on norms, biases and embeddings' small vectors: only matrices are decayed.
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.99))


class TensorParallelCharLM(CharLM):
    """CharLM whose blocks carry a tensor-parallel plan (recipes/charlm_tp.yaml): under a strategy with
    `tensor_parallel: N`, each block's MLP is split across the N ranks of `self.device_mesh["tp"]`, its first linear
    by output columns and its second by input rows, so the hidden activation (4 x width) never leaves its rank and one
    all-reduce per block joins the halves. Attention stays whole on every rank: its fused qkv projection is laid out
    [q | k | v], which a column split would cut across heads. The weights keep CharLM's names and shapes, so its
    checkpoints load into CharLM and back."""

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or mesh["tp"].size() == 1:
            return
        # Imported here: DTensor's parallel styles are needed only where a mesh splits the model.
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from torchyard.trainer.strategies.mesh import parallelize

        plan = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
        for block in self.blocks:
            if not isinstance(block.mlp[0].weight, DTensor):  # a later stage calls configure_model again
                parallelize(block, mesh["tp"], plan)  # parallelize_module, refusing a key that names no layer


# --------------------------------------------------------------------------- the data


class CharBlocks(Dataset):
    """Consecutive, non-overlapping windows of a token stream: (input, the same shifted by one)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.tokens[start: start + self.block_size + 1]
        return window[:-1], window[1:]


class CharData(DataModule):
    """The corpus split by position (the first 90% trains, the rest validates); prompts for predict."""

    def __init__(self, files: tuple[str, ...] = CORPUS_FILES, block_size: int = 128, batch_size: int = 32,
                 val_fraction: float = 0.1, num_workers: int = 0,
                 prompts: tuple[str, ...] = ("def ", "class Parser:\n    ", "import ")) -> None:
        super().__init__()
        check_loader_args(type(self).__name__, batch_size, num_workers)
        if not prompts or not all(prompts):
            raise MisconfigurationError(f"CharData: prompts={list(prompts)!r}: predict continues each prompt, so give "
                                        "one or more non-empty strings (data.init_args.prompts in a recipe).")
        self.save_hyperparameters()
        self.train_set: CharBlocks | None = None
        self.val_set: CharBlocks | None = None

    def setup(self, stage: str) -> None:
        tokens = encode(read_corpus(self.hparams.files))
        split = int(len(tokens) * (1 - self.hparams.val_fraction))
        self.train_set = CharBlocks(tokens[:split], self.hparams.block_size)
        self.val_set = CharBlocks(tokens[split:], self.hparams.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        # One prompt per batch: prompts differ in length, and sampling is cheap next to training.
        return DataLoader([encode(prompt) for prompt in self.hparams.prompts], batch_size=1)
