import io
import os

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


# The first bf16 product timed after the warm-up, or the last of the 5 rounds of 4.
@pytest.mark.measures_bf16_speed
@pytest.mark.parametrize("late", [2, 1 + 5 * 4])
def test_one_busy_moment_does_not_pick_the_precision(monkeypatch, late):
    # A machine where a bf16 product takes 1 ms and an fp32 one 2 ms, but one bf16 product
    # timed comes 12 ms late (the machine busy elsewhere for a moment): bf16 is still twice as
    # fast, and still the choice.
    clock, bf16_products = [0.0], []

    def product(a, b):
        if a.dtype == torch.bfloat16:
            bf16_products.append(a)
            clock[0] += 0.001 + (0.012 if len(bf16_products) == late else 0.0)
        else:
            clock[0] += 0.002
        return a

    monkeypatch.setattr(torch.Tensor, "__matmul__", product)
    monkeypatch.setattr(devices.time, "perf_counter", lambda: clock[0])
    assert devices.bf16_speedup_on_cpu() == pytest.approx(2.0)
    bf16_products.clear()  # the same busy moment, as the scripts pick their precision
    assert devices.default_precision(torch.device("cpu")) == "bf16"


def test_the_gpu_is_picked_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.pick_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert devices.pick_device() == torch.device("mps")


@pytest.mark.parametrize("capability, precision", [((7, 5), "fp32"), ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_a_cuda_gpu_gets_bf16_where_it_multiplies_it_itself(monkeypatch, capability, precision):
    # A T4 (7.5) only emulates bf16, though torch's is_bf16_supported() says yes, as it does
    # for any CUDA GPU that can make a bf16 tensor.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert devices.default_precision(torch.device("cuda")) == precision


@pytest.mark.parametrize("speedup, precision", [(1.2, "fp32"), (2.1, "bf16")])
def test_a_cpu_gets_bf16_only_where_it_is_clearly_faster(monkeypatch, speedup, precision):
    monkeypatch.setattr(devices, "bf16_speedup_on_cpu", lambda: speedup)
    assert devices.default_precision(torch.device("cpu")) == precision


def test_a_resumed_run_keeps_its_precision_on_the_kind_of_device_it_started_on(monkeypatch, capsys):
    monkeypatch.setattr(devices, "bf16_speedup_on_cpu", lambda: 1.2)  # this CPU would pick fp32
    cpu = torch.device("cpu")
    assert devices.resumed_precision({"device": "cpu", "precision": "fp32"}, cpu) == "fp32"
    assert capsys.readouterr().out == ""
    assert devices.resumed_precision({"device": "cpu", "precision": "bf16"}, cpu) == "bf16"
    assert "--precision fp32" in capsys.readouterr().out  # said, as this CPU would pick fp32
    assert devices.resumed_precision({"device": "cuda:0", "precision": "bf16"}, cpu) == "fp32"
    assert devices.resumed_precision({"device": "cpu"}, cpu) == "fp32"  # a run that recorded none


def test_autocast_multiplies_in_bf16_only_when_asked():
    a = torch.randn(4, 4)
    with devices.autocast("cpu", "bf16"):
        assert (a @ a).dtype == torch.bfloat16
    with devices.autocast(torch.device("cpu"), "fp32"):
        assert (a @ a).dtype == torch.float32


def test_a_gpu_is_refused_by_its_number_where_the_machine_has_fewer(monkeypatch):
    # On a machine of one GPU, cuda:1 is refused in one line, not a traceback at the first tensor moved there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices.pick_device("cuda") == torch.device("cuda")
    assert devices.pick_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(SystemExit, match="has no cuda:1"):
        devices.pick_device("cuda:1")


def test_apple_s_gpu_is_mps_or_mps_0_and_no_other_number(monkeypatch):
    # A Mac has one GPU: mps:1 is refused in one line, not a traceback at the first tensor moved there.
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert devices.pick_device("mps") == torch.device("mps")
    assert devices.pick_device("mps:0") == torch.device("mps:0")
    with pytest.raises(SystemExit, match="has no mps:1"):
        devices.pick_device("mps:1")


def test_apple_s_mps_trains_in_fp32():
    # bf16 is picked only where the device is known or timed to multiply it faster: MPS is neither.
    assert devices.default_precision(torch.device("mps")) == "fp32"


def test_a_run_begun_under_torchrun_keeps_its_precision_on_one_gpu_of_the_same_kind(monkeypatch):
    # A run's settings record its process's GPU, cuda:1; resumed in one process it runs on cuda.
    # Begun with --precision fp32 on a GPU that would pick bf16, it goes on in fp32.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert devices.resumed_precision({"device": "cuda:1", "precision": "fp32"}, torch.device("cuda")) == "fp32"


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7763 64-Core Processor
"""


@pytest.mark.parametrize("cpuinfo, cpu", [(CPUINFO, "AMD EPYC 7763 64-Core Processor"),
                                          ("processor\t: 0\nBogoMIPS\t: 48.00\nCPU part\t: 0xd08\n", "aarch64")])
def test_the_machine_is_its_cpu_s_model_name_cores_and_gpu(monkeypatch, cpuinfo, cpu):
    # The line the report and the benchmarks' figures are measured on. /proc/cpuinfo's "model"
    # line (a number) comes before its "model name", and an ARM CPU's may have no model name at
    # all: then the platform's name. The cores are the machine's, the threads torch's.
    monkeypatch.setattr(devices, "open", lambda path: io.StringIO(cpuinfo), raising=False)
    monkeypatch.setattr(devices.platform, "processor", lambda: "")
    monkeypatch.setattr(devices.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert devices.machine() == f"{cpu}, 64 cores, NVIDIA H100 80GB HBM3; torch {torch.__version__}, 2 threads"
