"""Pure PyTorch orthogonal math: no Hugging Face imports. Every other module of poet_hf builds on it."""

from .base_init import BASE_INIT_SCHEMES, init_base_weight
from .cayley import (
    cayley,
    cayley_neumann,
    neumann_error_bound,
    num_skew_params,
    orthogonal_from_vector,
    random_skew_params,
    skew_from_vector,
)
from .cayley_map import CayleyNeumann
from .eco import EcoConv2d, construct_index_map, eco_kernel
from .feedback_gd import FeedbackGD, stiefel_deviation
from .householder import (
    apply_householder_sequence,
    householder_decompose,
    householder_matrix,
    householder_product_blocked,
    householder_product_sequential,
    householder_reflect,
)
from .householder_map import HouseholderProduct
from .linalg import orthogonality_error, polar_factor, power_iteration, random_orthogonal, taylor_exp
from .map_protocol import OrthogonalMap
from .maps import MAPS, map_from_config
from .reflection import (
    AuxiliaryReflection,
    NewtonConvergenceError,
    auxiliary_reflection,
    auxiliary_reflection_inverse,
    auxiliary_reflection_jacobian,
    auxiliary_reflection_logabsdet,
    invertible_weight,
)
from .spo import (
    block_matmul_left,
    block_matmul_right,
    inverse_permutation,
    sample_permutation,
    sample_subset,
    spo_generator,
    subset_matmul_left,
    subset_matmul_right,
    subset_size,
)

__all__ = [
    "OrthogonalMap",
    "MAPS",
    "map_from_config",
    "CayleyNeumann",
    "HouseholderProduct",
    "FeedbackGD",
    "stiefel_deviation",
    "BASE_INIT_SCHEMES",
    "init_base_weight",
    "cayley",
    "cayley_neumann",
    "neumann_error_bound",
    "num_skew_params",
    "orthogonal_from_vector",
    "random_skew_params",
    "skew_from_vector",
    "orthogonality_error",
    "polar_factor",
    "power_iteration",
    "random_orthogonal",
    "taylor_exp",
    "block_matmul_left",
    "block_matmul_right",
    "inverse_permutation",
    "sample_permutation",
    "sample_subset",
    "spo_generator",
    "subset_matmul_left",
    "subset_matmul_right",
    "subset_size",
    "apply_householder_sequence",
    "householder_decompose",
    "householder_matrix",
    "householder_product_blocked",
    "householder_product_sequential",
    "householder_reflect",
    "AuxiliaryReflection",
    "NewtonConvergenceError",
    "auxiliary_reflection",
    "auxiliary_reflection_inverse",
    "auxiliary_reflection_jacobian",
    "auxiliary_reflection_logabsdet",
    "invertible_weight",
    "EcoConv2d",
    "construct_index_map",
    "eco_kernel",
]
