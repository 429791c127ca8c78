"""bench/report.py: a row whose outputs are not the lengths its options fix says so, in its note and on stderr."""
from __future__ import annotations

from bench.report import length_notes


def test_outputs_of_the_fixed_lengths_leave_no_note(capsys):
    assert length_notes(31154, 31154) == []
    assert capsys.readouterr().err == ""


def test_outputs_of_other_lengths_are_a_wrong_result_in_the_note_and_on_stderr(capsys):
    notes = length_notes(30116, 31154)
    assert notes == ["WRONG LENGTHS: ours produced 30116 tokens (expected 31154 + lang)"]
    assert notes[0] in capsys.readouterr().err
