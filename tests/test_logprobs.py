import math

import torch

from posttrain.losses.logprobs import next_token_logps, selective_log_softmax


def test_selective_log_softmax_matches_float64_reference():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]]])
    ids = torch.tensor([[2, 0]])
    got = selective_log_softmax(logits, ids)
    ref = [3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3)),
           0.5 - math.log(math.exp(0.5) + math.exp(-1.0) + math.exp(0.0))]
    torch.testing.assert_close(got, torch.tensor([ref], dtype=torch.float32))


def test_next_token_logps_alignment():
    logits = torch.randn(1, 3, 5, dtype=torch.float64)
    ids = torch.tensor([[4, 1, 3]])
    got = next_token_logps(logits, ids)
    lsm = torch.log_softmax(logits, -1)
    assert got[0, 0] == 0
    torch.testing.assert_close(got[0, 1:], torch.stack([lsm[0, 0, 1], lsm[0, 1, 3]]))
