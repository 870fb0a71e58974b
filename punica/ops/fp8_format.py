"""The e4m3 format's constants that the fp8 ops and their kernels share."""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_ACTIVATION_AMAX = 1e-12  # a row of zeros gets this amax, so its scale is not 0
