"""Array helpers that follow core's rules, for backends.

:func:`convert_to_array` converts Python scalars and array-likes with TF's dtype rule
(what core hands ``Backend.place``); :func:`mean_from_sum` is MEAN's rule (true
division by the replica count; integers become float64); :func:`describe` and
:func:`dtype_name` format arrays for error messages and traces.
"""

from polydist._base.arrays import convert_to_array as convert_to_array
from polydist._base.arrays import describe as describe
from polydist._base.arrays import dtype_name as dtype_name
from polydist._base.arrays import is_array as is_array
from polydist._base.arrays import mean_from_sum as mean_from_sum

__all__ = ["convert_to_array", "describe", "dtype_name", "is_array", "mean_from_sum"]
