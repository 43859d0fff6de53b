"""Finding a tensor's raw bytes inside a torch.save record from its first page alone."""

from __future__ import annotations

import io

import pytest
import torch

from trainer.checkpoint.torch_record import locate_tensor_bytes


def _record(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("tensor", [torch.randn(300, 7), torch.randn(9).to(torch.bfloat16),
                                    torch.arange(50, dtype=torch.int64), torch.tensor(2.5)],
                         ids=["float32", "bfloat16", "int64", "scalar"])
def test_the_bytes_found_are_exactly_the_tensors_bytes(tensor):
    record = _record(tensor)
    found = locate_tensor_bytes(record[:4096])
    assert (found.dtype, found.shape) == (tensor.dtype, tuple(tensor.shape))
    raw = record[found.offset:found.offset + found.nbytes]
    assert raw == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("tensor", [torch.randn(8, 8)[:, ::2], torch.randn(10)[3:],
                                    torch.randn(4, 4).t(), torch.randn(3).to(torch.complex64)],
                         ids=["strided-view", "offset-view", "transposed", "complex"])
def test_records_that_are_not_a_plain_contiguous_tensor_are_left_to_torch_load(tensor):
    assert locate_tensor_bytes(_record(tensor)[:4096]) is None


def test_garbage_and_other_pickles_are_not_mistaken_for_a_tensor():
    assert locate_tensor_bytes(b"PK\x03\x04" + bytes(4092)) is None
    assert locate_tensor_bytes(_record({"a": 1})[:4096]) is None
