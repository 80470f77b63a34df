"""A model that draws random numbers in every training step (dropout on the token embeddings), for the tests
that must see each rank's random number generators carried over a recovery: the shipped models draw none.
Workers import it by `model._target_=dropout_model.DropoutLlama` with this folder on their PYTHONPATH."""

from __future__ import annotations

import torch.nn.functional as F

from distrain.config import ModelConfig
from distrain.model.llama import Transformer

P = 0.2


class DropoutLlama(Transformer):
    def __init__(self, cfg: ModelConfig, max_seq_len: int, seed: int = 0):
        super().__init__(cfg, max_seq_len, seed)
        self.tok_embeddings.register_forward_hook(lambda module, _, out: F.dropout(out, P, module.training))
