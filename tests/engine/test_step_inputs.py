"""The decode step's gathered inputs: named [N] views the kernels can take as they are."""
import numpy as np
import torch

from engine.step_inputs import RowInputs, StepInputs


def test_gathered_rows_give_contiguous_field_views_in_gather_order() -> None:
    inputs = StepInputs(10)
    inputs.table.position[:] = np.arange(10) * 10
    batch = inputs.gather(np.array([7, 1, 5]))
    device = RowInputs(torch.from_numpy(batch.buffer))
    for name in RowInputs.FIELDS:
        assert getattr(device, name).is_contiguous(), name
    assert device.row.tolist() == [7, 1, 5]
    assert device.position.tolist() == [70, 10, 50]


def test_gather_is_a_copy_and_a_slice_is_a_view() -> None:
    inputs = StepInputs(4)
    copy = inputs.gather(np.array([0, 1]))
    copy.token[:] = 9
    assert inputs.table.token.tolist() == [0, 0, 0, 0]
    view = inputs.table.columns(slice(0, 2))
    view.token[:] = 3
    assert inputs.table.token.tolist() == [3, 3, 0, 0]
