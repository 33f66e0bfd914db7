"""The staged swap's shadow copy of a vLLM model whose parameters are vLLM's own classes (``BasevLLMParameter``,
kept where no CPU kernel repacks the weights: bf16 on a CPU without AVX-512). ``copy.deepcopy`` alone refuses them
("BasevLLMParameter.__new__() takes 2 positional arguments"), which made every staged push to such a replica fail."""

import copy

import pytest
import torch

parameter = pytest.importorskip("vllm.model_executor.parameter")

from services.rollout import vllm_shadow  # noqa: E402 - after the vllm skip


class _Layer(torch.nn.Module):
    def __init__(self, monkeypatch):
        super().__init__()
        # BasevLLMParameter reads the tensor-parallel rank and size, which only a running vLLM worker has
        monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
        self.weight = parameter.BasevLLMParameter(data=torch.randn(4, 3), weight_loader=self.load)
        self.bias = torch.nn.Parameter(torch.randn(4))

    def load(self, param, loaded):
        param.data.copy_(loaded)


def test_the_shadow_copies_vllm_parameter_classes_with_their_loaders(monkeypatch):
    live = torch.nn.Sequential(_Layer(monkeypatch))
    with pytest.raises(TypeError, match="positional"):
        copy.deepcopy(live)  # what the staged swap did before

    memo: dict[int, object] = {}
    vllm_shadow._memo_parameter_subclasses(live, memo)
    twin = copy.deepcopy(live, memo)
    vllm_shadow._copy_tensor_attrs(live[0], twin[0])

    w, tw = live[0].weight, twin[0].weight
    assert type(tw) is type(w) and torch.equal(tw, w) and tw.data_ptr() != w.data_ptr()
    assert tw.weight_loader.__self__ is twin[0]  # loads into the shadow, not the live layer
    tw.weight_loader(tw, torch.zeros(4, 3))
    assert torch.count_nonzero(tw) == 0 and torch.count_nonzero(w) > 0
    assert torch.equal(twin[0].bias, live[0].bias) and twin[0].bias.data_ptr() != live[0].bias.data_ptr()
