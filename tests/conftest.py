import os

import pytest
import torch

# Two cores, several processes: one thread each keeps the suite predictable.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def tiny_model():
    from node.model import load_model

    return load_model("tiny:4", seed=0)[0]
