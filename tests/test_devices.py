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


def test_one_busy_moment_does_not_pick_the_precision(monkeypatch):
    # A machine where a bf16 product takes 1 ms and an fp32 one 2 ms, but the first bf16
    # product timed comes 12 ms late (the machine busy elsewhere for a moment): bf16 is still
    # twice as fast, and still the choice.
    clock, bf16_products = [0.0], []

    def product(a, b):
        if a.dtype == torch.bfloat16:
            bf16_products.append(a)
            clock[0] += 0.001 + (0.012 if len(bf16_products) == 2 else 0.0)  # the first after the warm-up
        else:
            clock[0] += 0.002
        return a

    monkeypatch.setattr(torch.Tensor, "__matmul__", product)
    monkeypatch.setattr(devices.time, "perf_counter", lambda: clock[0])
    assert devices.bf16_speedup_on_cpu() == pytest.approx(2.0)
    bf16_products.clear()  # the same busy moment, as the scripts pick their precision
    assert devices.default_precision(torch.device("cpu")) == "bf16"
