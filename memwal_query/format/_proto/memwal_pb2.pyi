from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVE: _ClassVar[RegionStatus]
    SEALED: _ClassVar[RegionStatus]
ACTIVE: RegionStatus
SEALED: RegionStatus

class UUID(_message.Message):
    __slots__ = ("uuid",)
    UUID_FIELD_NUMBER: _ClassVar[int]
    uuid: bytes
    def __init__(self, uuid: _Optional[bytes] = ...) -> None: ...

class FlushedGeneration(_message.Message):
    __slots__ = ("generation", "path", "in_memory_bytes", "physical_rows", "primary_key_bytes")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IN_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    path: str
    in_memory_bytes: int
    physical_rows: int
    primary_key_bytes: int
    def __init__(self, generation: _Optional[int] = ..., path: _Optional[str] = ..., in_memory_bytes: _Optional[int] = ..., physical_rows: _Optional[int] = ..., primary_key_bytes: _Optional[int] = ...) -> None: ...

class RegionFieldEntry(_message.Message):
    __slots__ = ("field_id", "value")
    FIELD_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    field_id: str
    value: bytes
    def __init__(self, field_id: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class RegionManifest(_message.Message):
    __slots__ = ("region_id", "version", "region_spec_id", "writer_epoch", "replay_after_wal_entry_position", "wal_entry_position_last_seen", "current_generation", "flushed_generations", "region_field_entries", "status", "lineage", "stream_batches")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REGION_SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    WRITER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLAY_AFTER_WAL_ENTRY_POSITION_FIELD_NUMBER: _ClassVar[int]
    WAL_ENTRY_POSITION_LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    CURRENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    STREAM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    region_id: UUID
    version: int
    region_spec_id: int
    writer_epoch: int
    replay_after_wal_entry_position: int
    wal_entry_position_last_seen: int
    current_generation: int
    flushed_generations: _containers.RepeatedCompositeFieldContainer[FlushedGeneration]
    region_field_entries: _containers.RepeatedCompositeFieldContainer[RegionFieldEntry]
    status: RegionStatus
    lineage: str
    stream_batches: _containers.RepeatedCompositeFieldContainer[StreamBatch]
    def __init__(self, region_id: _Optional[_Union[UUID, _Mapping]] = ..., version: _Optional[int] = ..., region_spec_id: _Optional[int] = ..., writer_epoch: _Optional[int] = ..., replay_after_wal_entry_position: _Optional[int] = ..., wal_entry_position_last_seen: _Optional[int] = ..., current_generation: _Optional[int] = ..., flushed_generations: _Optional[_Iterable[_Union[FlushedGeneration, _Mapping]]] = ..., region_field_entries: _Optional[_Iterable[_Union[RegionFieldEntry, _Mapping]]] = ..., status: _Optional[_Union[RegionStatus, str]] = ..., lineage: _Optional[str] = ..., stream_batches: _Optional[_Iterable[_Union[StreamBatch, _Mapping]]] = ...) -> None: ...

class StreamBatch(_message.Message):
    __slots__ = ("stream", "batch")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    stream: str
    batch: int
    def __init__(self, stream: _Optional[str] = ..., batch: _Optional[int] = ...) -> None: ...

class MergedGeneration(_message.Message):
    __slots__ = ("region_id", "generation")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    region_id: UUID
    generation: int
    def __init__(self, region_id: _Optional[_Union[UUID, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class IndexCatchupProgress(_message.Message):
    __slots__ = ("index_name", "caught_up_generations")
    INDEX_NAME_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    index_name: str
    caught_up_generations: _containers.RepeatedCompositeFieldContainer[MergedGeneration]
    def __init__(self, index_name: _Optional[str] = ..., caught_up_generations: _Optional[_Iterable[_Union[MergedGeneration, _Mapping]]] = ...) -> None: ...

class RegionField(_message.Message):
    __slots__ = ("field_id", "source_ids", "transform", "expression", "result_type", "parameters")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FIELD_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFORM_FIELD_NUMBER: _ClassVar[int]
    EXPRESSION_FIELD_NUMBER: _ClassVar[int]
    RESULT_TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    field_id: str
    source_ids: _containers.RepeatedScalarFieldContainer[int]
    transform: str
    expression: str
    result_type: str
    parameters: _containers.ScalarMap[str, str]
    def __init__(self, field_id: _Optional[str] = ..., source_ids: _Optional[_Iterable[int]] = ..., transform: _Optional[str] = ..., expression: _Optional[str] = ..., result_type: _Optional[str] = ..., parameters: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegionSpec(_message.Message):
    __slots__ = ("spec_id", "fields")
    SPEC_ID_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    spec_id: int
    fields: _containers.RepeatedCompositeFieldContainer[RegionField]
    def __init__(self, spec_id: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[RegionField, _Mapping]]] = ...) -> None: ...

class MemWalIndexDetails(_message.Message):
    __slots__ = ("snapshot_ts_millis", "num_regions", "inline_snapshots", "region_specs", "maintained_indexes", "merged_generations", "index_catchup", "writer_config_defaults")
    class WriterConfigDefaultsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SNAPSHOT_TS_MILLIS_FIELD_NUMBER: _ClassVar[int]
    NUM_REGIONS_FIELD_NUMBER: _ClassVar[int]
    INLINE_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    REGION_SPECS_FIELD_NUMBER: _ClassVar[int]
    MAINTAINED_INDEXES_FIELD_NUMBER: _ClassVar[int]
    MERGED_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    INDEX_CATCHUP_FIELD_NUMBER: _ClassVar[int]
    WRITER_CONFIG_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    snapshot_ts_millis: int
    num_regions: int
    inline_snapshots: bytes
    region_specs: _containers.RepeatedCompositeFieldContainer[RegionSpec]
    maintained_indexes: _containers.RepeatedScalarFieldContainer[str]
    merged_generations: _containers.RepeatedCompositeFieldContainer[MergedGeneration]
    index_catchup: _containers.RepeatedCompositeFieldContainer[IndexCatchupProgress]
    writer_config_defaults: _containers.ScalarMap[str, str]
    def __init__(self, snapshot_ts_millis: _Optional[int] = ..., num_regions: _Optional[int] = ..., inline_snapshots: _Optional[bytes] = ..., region_specs: _Optional[_Iterable[_Union[RegionSpec, _Mapping]]] = ..., maintained_indexes: _Optional[_Iterable[str]] = ..., merged_generations: _Optional[_Iterable[_Union[MergedGeneration, _Mapping]]] = ..., index_catchup: _Optional[_Iterable[_Union[IndexCatchupProgress, _Mapping]]] = ..., writer_config_defaults: _Optional[_Mapping[str, str]] = ...) -> None: ...
