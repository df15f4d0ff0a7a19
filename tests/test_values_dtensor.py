"""DTensors coming back to the notebook (issue 35): a tensor-parallel state_dict (or anything holding a
DTensor) is refused with the fix and the place of the first DTensor, never sent as rank 0's shard with a
DeviceMesh the notebook cannot resolve. Real DTensors on 2 gloo CPU ranks, through a real kernel."""
import pytest

pytestmark = pytest.mark.timeout(180)

MAKE = ("from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import DTensor, Shard, distribute_tensor\n"
        "mesh = init_device_mesh('cpu', (2,))\n"
        "sd = {'bias': torch.zeros(2), 'layer.weight': distribute_tensor(torch.arange(8.).reshape(4, 2), mesh, "
        "[Shard(0)])}\n")


def test_out_of_a_state_dict_holding_dtensors_is_refused_with_the_fix(clean_kernel):
    res = clean_kernel.run("%%ddp --devices 2 --out sd --gather t\n" + MAKE + "t = sd['layer.weight']\n", timeout=90)
    text = res.error_text
    assert res.error["ename"] == "ResultError", text
    assert "--out sd: rank 0's `sd`: dict holds a DTensor at ['layer.weight']" in text, text
    assert "v.full_tensor() if isinstance(v, DTensor)" in text and "full_state_dict=True" in text, text
    assert "--gather t: rank 1's `t`: torch.distributed.tensor.DTensor is a DTensor" in text, text
    assert "value.full_tensor()" in text and "Send plain data" in text, text
    assert "DeviceMesh" not in res.stderr and "Warning" not in res.stderr, res.stderr  # never pickled
    assert clean_kernel.value("'sd' in dir()") is False


def test_the_fix_sends_full_tensors(clean_kernel):
    clean_kernel.ok("%%ddp --devices 2 --out sd\n" + MAKE +
                    "sd = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}\n", timeout=90)
    assert clean_kernel.value("sd['layer.weight'].tolist()") == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert clean_kernel.value("type(sd['layer.weight']).__name__") == "Tensor"


def test_launch_returning_a_dtensor_names_it(clean_kernel):
    res = clean_kernel.run(
        "import nbddp\ndef shard():\n    import torch\n" + "".join(f"    {line}\n" for line in MAKE.splitlines())
        + "    return [sd]\nnbddp.launch(shard, devices=2)\n", timeout=90)
    text = res.error_text
    assert res.error["ename"] == "ResultError", text
    assert "rank 0's return value: list holds a DTensor at [0]['layer.weight']" in text, text
    assert "rank 1's return value" in text and "full_tensor()" in text, text
