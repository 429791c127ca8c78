"""The decode step's gathered inputs: named [N] views the kernels can take as they are."""
from types import SimpleNamespace

import numpy as np
import torch

from engine.step_inputs import RowInputs, StepInputs, rows_per_source


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


def test_rows_per_source_is_the_row_count_every_segment_shares_past_32_rows() -> None:
    assert rows_per_source([4] * 16) == 4
    assert rows_per_source([8] * 8 + [4] * 8) == 4
    assert rows_per_source([6] * 11) == 6
    assert rows_per_source([2] * 17) == 2
    assert rows_per_source([4] * 16 + [1]) == 1  # a greedy segment among beams
    assert rows_per_source([4] * 8) == 1  # 32 rows: each row's cross-attention takes four warps anyway
    assert rows_per_source([1] * 1024) == 1


def test_live_rows_carry_their_segments_common_row_count() -> None:
    inputs = StepInputs(200)
    beams = [SimpleNamespace(rows=list(range(i * 4, i * 4 + 4))) for i in range(16)]
    assert inputs.live(beams, version=1).tolist() == list(range(64))
    assert inputs.rows_per_source == 4
    greedy = SimpleNamespace(rows=[100])
    inputs.live(beams + [greedy], version=2)
    assert inputs.rows_per_source == 1
