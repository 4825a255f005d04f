"""The engine's torch thread count for its steps: one on an accelerator unless configured, the CPU's untouched."""

import pytest
import torch

from cluster.config import TandemConfig, with_overrides
from cluster.runner.worker import use_step_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_an_accelerator_steps_on_one_thread(threads):
    use_step_threads(TandemConfig(), torch.device("cuda", 0))  # only the device's type is read
    assert torch.get_num_threads() == 1


def test_num_threads_named_for_an_accelerator_is_kept(threads):
    use_step_threads(with_overrides(TandemConfig(), num_threads=2), torch.device("cuda", 0))
    assert torch.get_num_threads() == 2


def test_the_cpu_keeps_its_compute_threads(threads):
    use_step_threads(TandemConfig(), torch.device("cpu"))
    assert torch.get_num_threads() == 2
