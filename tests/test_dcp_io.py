"""Reading DCP directories never unpickles arbitrary objects."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.dcp_io import load_dcp_in_place, read_dcp_metadata, read_dcp_state_dict


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_referring_to_foreign_code_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        read_dcp_metadata(tmp_path)


def test_real_metadata_and_nested_non_tensor_values_load(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "groups": [{"lr": 0.5, "betas": (0.9, 0.99), "params": ["w"]}]}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    target = {"w": torch.zeros(2, 3), "groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]}
    load_dcp_in_place(target, tmp_path)
    assert torch.equal(target["w"], state["w"])
    assert target["groups"] == state["groups"]
    assert set(read_dcp_state_dict(tmp_path)) == {"w"}  # a plain read keeps tensors only
