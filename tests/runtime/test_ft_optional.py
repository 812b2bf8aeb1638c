"""manager= without torchft installed: an ImportError that names the extra to install."""

import sys

import pytest
import torch
from torch import nn

from lowcomm_kernels.runtime.ft import INSTALL_HINT, require_torchft


def test_missing_torchft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lowcomm-kernels\[ft\]'"):
        require_torchft()
    from lowcomm_kernels.runtime import DiLoCo

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ImportError, match=r"lowcomm-kernels\[ft\]"):
        DiLoCo(model, opt, sync_every=2, outer_lr=0.7, outer_momentum=0.9, manager=object(), num_replicas=2)
    assert "lowcomm-kernels[ft]" in INSTALL_HINT


def test_manager_arguments_are_checked_by_name():
    pytest.importorskip("torchft")
    from lowcomm_kernels.runtime import DiLoCo

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        DiLoCo(model, opt, manager=object(), num_replicas=2, **kw)
    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        DiLoCo(model, opt, num_replicas=2, **kw)  # num_replicas without a manager
