"""What the asynchronous producer knows of a method is declared on its class: whether its loss reads the sampler's
log-probs (so stale samples are corrected) and whether it generates on its own. A subclass that brings its own loss
or generation loses the inherited claim unless it restates it, so the producer never trusts a loss it has not been
told about."""

from posttrain import GRPOTrainer, PPOTrainer, RLOOTrainer
from posttrain.experimental.a2po import A2POTrainer
from posttrain.experimental.async_distillation import AsyncDistillationTrainer
from posttrain.experimental.async_grpo import AsyncGRPOTrainer
from posttrain.experimental.gmpo import GMPOTrainer
from posttrain.experimental.online_dpo import OnlineDPOTrainer
from posttrain.online.engine import OnlineTrainer


def test_the_stable_methods_declare_a_corrected_loss():
    for method in (OnlineTrainer, GRPOTrainer, RLOOTrainer, PPOTrainer, AsyncGRPOTrainer):
        assert method.loss_reads_sampler_logps, method.__name__
        assert not method.own_generation, method.__name__


def test_a_subclass_with_its_own_loss_is_not_trusted_unless_it_says_so():
    class OwnPolicyLoss(GRPOTrainer):
        def policy_loss(self, inputs, logps, entropy=None, keep=None):
            raise NotImplementedError

    class OwnComputeLoss(RLOOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            raise NotImplementedError

    class Restated(GRPOTrainer):
        loss_reads_sampler_logps = True

        def policy_loss(self, inputs, logps, entropy=None, keep=None):
            raise NotImplementedError

    class Inherits(OwnPolicyLoss):
        pass

    assert not OwnPolicyLoss.loss_reads_sampler_logps
    assert not OwnComputeLoss.loss_reads_sampler_logps
    assert Restated.loss_reads_sampler_logps
    assert not Inherits.loss_reads_sampler_logps
    assert not (A2POTrainer.loss_reads_sampler_logps or GMPOTrainer.loss_reads_sampler_logps)
    assert AsyncDistillationTrainer.loss_ignores_the_sampler and not AsyncDistillationTrainer.loss_reads_sampler_logps


def test_own_generation_is_inherited():
    class OwnGeneration(GRPOTrainer):
        def generate_episodes(self, rows, n, seeds):
            raise NotImplementedError

    class Below(OwnGeneration):
        pass

    assert OwnGeneration.own_generation and Below.own_generation
    assert OnlineDPOTrainer.own_generation == ("generate_episodes" in vars(OnlineDPOTrainer))
