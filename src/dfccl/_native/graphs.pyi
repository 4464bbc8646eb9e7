from typing import Any

class CapturedNode:
    slot: int
    key: int
    tags: Any
    released: int
    kind: str
    tag: Any
    rank: int
    endpoint: int
    first_instance: int
    owners: object
    aux: tuple[int, int] | None
    failed: BaseException | None
    reported: int

class GraphCaptures:
    def reap(self) -> int: ...
    def held_by(self, endpoint: int) -> int: ...
    def captured(self) -> list[dict[str, Any]]: ...
    def stream_wait(self, stream: int, slot: int) -> None: ...
    def check(self) -> None: ...
    def scan(self, every: bool = False) -> None: ...
    def close(self) -> int: ...
