from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SloClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLO_CLASS_UNSPECIFIED: _ClassVar[SloClass]
    SLO_CLASS_INTERACTIVE: _ClassVar[SloClass]
    SLO_CLASS_STANDARD: _ClassVar[SloClass]
    SLO_CLASS_BATCH: _ClassVar[SloClass]
SLO_CLASS_UNSPECIFIED: SloClass
SLO_CLASS_INTERACTIVE: SloClass
SLO_CLASS_STANDARD: SloClass
SLO_CLASS_BATCH: SloClass

class TierTokens(_message.Message):
    __slots__ = ("device", "host", "spill_ram", "spill_disk")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SPILL_RAM_FIELD_NUMBER: _ClassVar[int]
    SPILL_DISK_FIELD_NUMBER: _ClassVar[int]
    device: int
    host: int
    spill_ram: int
    spill_disk: int
    def __init__(self, device: _Optional[int] = ..., host: _Optional[int] = ..., spill_ram: _Optional[int] = ..., spill_disk: _Optional[int] = ...) -> None: ...
