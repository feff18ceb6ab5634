"""Trainer-side helpers: import these to recompute rollout log-probs and to sync weights.

    from rl import TrainerPolicy, Trajectory, sde_step, state_dict_checksum, save_weights
"""

from common.wan.sde import log_prob_of, sde_step
from common.wan.weights import save_weights, state_dict_checksum
from rl.policy import TrainerPolicy, Trajectory

__all__ = ["TrainerPolicy", "Trajectory", "sde_step", "log_prob_of", "state_dict_checksum", "save_weights"]
