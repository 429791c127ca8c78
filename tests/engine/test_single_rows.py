"""SingleRows: a step's picks appended to every one-row search at once, against each search's sequence kept as a
Python list (the definition: append the pick, add its log-prob, done at </s> or max_length)."""
import random

import numpy as np

from engine.options import GenerationOptions
from engine.search import SearchContext, SingleRows, SingleSearch
from engine.tokenizer import PendingTexts

EOS, START = 2, 2


def test_appends_over_random_steps_match_each_sequence_kept_alone():
    rng = random.Random(5)
    rows, max_len = 9, 12
    table = SingleRows(max_len, EOS, np.zeros(rows, dtype=np.int64))
    alone: dict[int, tuple[list[int], float, int]] = {}  # row -> (sequence, log-prob sum, max_length)
    for _ in range(300):
        for row in rng.sample(range(rows), rng.randint(0, 2)):  # (re)admissions
            limit = rng.randint(2, max_len)
            table.max_length[row] = limit
            table.start(np.array([row]), np.array([START]))
            alone[row] = ([START], 0.0, limit)
        stepping = np.array(sorted(rng.sample(sorted(alone), rng.randint(0, len(alone)))), dtype=np.int64)
        tokens = np.array([rng.choice([EOS, 5, 6, 7, 8]) for _ in stepping], dtype=np.int64)
        logprobs = np.array([-rng.random() * 3 for _ in stepping])
        done = table.append(stepping, tokens, logprobs)
        for row, token, logprob, flagged in zip(stepping.tolist(), tokens.tolist(), logprobs.tolist(), done):
            seq, total, limit = alone[row]
            if len(seq) >= max_len:  # a row that keeps computing after its search was done: never read
                continue
            seq.append(token)
            alone[row] = (seq, total + logprob, limit)
            assert flagged == (token == EOS or len(seq) >= limit)
            if not flagged:
                assert table.sequence(row) == seq and table.logprob[row] == alone[row][1]
        some = np.array(sorted(alone), dtype=np.int64)
        done = table.finished(some)
        for k, row in enumerate(some.tolist()):  # as a Candidate cuts the row's sequence
            seq = table.sequence(row)
            ended = len(seq) > 1 and seq[-1] == EOS
            assert done.tokens[k] == (seq[2:-1] if ended else seq[2:]) and done.ended[k] == ended
            assert done.block[k, :done.count[k]].tolist() == done.tokens[k]
            assert done.logprob[k] == table.logprob[row] and done.generated[k] == len(seq) - 1


def test_a_bound_search_reads_its_row_until_done_then_keeps_its_own_copy():
    ctx = SearchContext(GenerationOptions(max_new_tokens=3), START, 256, EOS, 4, None)
    table = SingleRows(8, EOS, np.zeros(4, dtype=np.int64))
    search = SingleSearch(ctx)
    search.bind(table, 3)
    table.max_length[3] = 4
    table.start(np.array([3]), np.array([START]))
    assert not table.append(np.array([3]), np.array([256]), np.array([0.0]))[0]  # the forced language token
    assert search.histories() == [[START, 256]] and search.cur_len == 2 and not search.done
    assert not table.append(np.array([3]), np.array([9]), np.array([-0.5]))[0]
    assert search.next_tokens() == [9]
    assert table.append(np.array([3]), np.array([11]), np.array([-0.25]))[0]  # max_length 4
    search.finish(table.finished(np.array([3])), 0, PendingTexts([0], [["its text"]]))
    table.start(np.array([3]), np.array([START]))  # the row goes to another search
    assert search.done and search.histories() == [[START, 256, 9, 11]] and search.cur_len == 4
    (best,) = search.results()
    assert (best.tokens, best.score, best.ended, best.text) == ([9, 11], -0.75 / 3, False, "its text")  # max_length
