"""Region specs: how rows map to regions, one class per transform, and region pruning.

The public names are those of :mod:`memwal_query.regions.spec` (``RegionSpec``,
``RegionField``, ``bucket_spec``, ``identity_spec``...), plus the transform classes
(:data:`TRANSFORM_CLASSES`, the registry from the spec's transform names).
"""

from memwal_query.regions.spec import (
    EXPRESSION_FUNCTIONS,
    MAX_EXPRESSION_CHARS,
    MAX_REGION_VALUE_BYTES,
    TEMPORAL_TRANSFORMS,
    TRANSFORMS,
    Predicate,
    RegionField,
    RegionSpec,
    arrow_type_from_name,
    arrow_type_name,
    bucket_spec,
    bucket_values,
    check_partial_sources,
    expression_spec,
    field_id_of,
    hash_column,
    identity_spec,
    is_unsharded,
    multi_bucket_spec,
    murmur3_hash,
    murmur3_int64,
    murmur3_multi_hash,
    temporal_spec,
    truncate_spec,
    unsharded_spec,
)
from memwal_query.regions.transform import Transform
from memwal_query.regions.transforms import TRANSFORM_CLASSES, bind_transform

__all__ = [
    "EXPRESSION_FUNCTIONS",
    "MAX_EXPRESSION_CHARS",
    "MAX_REGION_VALUE_BYTES",
    "TEMPORAL_TRANSFORMS",
    "TRANSFORMS",
    "TRANSFORM_CLASSES",
    "Predicate",
    "RegionField",
    "RegionSpec",
    "Transform",
    "arrow_type_from_name",
    "arrow_type_name",
    "bind_transform",
    "bucket_spec",
    "bucket_values",
    "check_partial_sources",
    "expression_spec",
    "field_id_of",
    "hash_column",
    "identity_spec",
    "is_unsharded",
    "multi_bucket_spec",
    "murmur3_hash",
    "murmur3_int64",
    "murmur3_multi_hash",
    "temporal_spec",
    "truncate_spec",
    "unsharded_spec",
]
