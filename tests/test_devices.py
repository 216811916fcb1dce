import pytest
import torch

import devices


def test_pick_device_honours_an_override_and_refuses_what_is_not_there():
    assert devices.pick_device("cpu") == torch.device("cpu")
    for name in ("nonsense", "meta", "xpu", "vulkan"):  # torch knows the last three; the series runs on none
        with pytest.raises(SystemExit, match="not a device the series runs on"):
            devices.pick_device(name)
    with pytest.raises(SystemExit, match="has no cuda:99"):
        devices.pick_device("cuda:99")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="has no cuda"):
            devices.pick_device("cuda")
