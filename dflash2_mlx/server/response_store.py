"""The Responses API's bounded in-memory store of recent responses (`previous_response_id`)."""

from __future__ import annotations

from collections import OrderedDict

from .errors import APIError

STORE_SIZE = 256


class ResponseStore:
    """The last `size` stored responses: their conversation (chat messages, system excluded) and object."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self.items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        self.items[response_id] = (messages, response)
        self.items.move_to_end(response_id)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str = "previous_response_id") -> tuple[list[dict], dict]:
        if response_id not in self.items:
            raise APIError(400 if param == "previous_response_id" else 404,
                           f"{param} {response_id!r} is not in this server's response store (it keeps the last "
                           f"{self.size} responses made with store: true, in memory); send the whole conversation "
                           "as input instead", "invalid_value" if param == "previous_response_id" else "not_found",
                           param)
        return self.items[response_id]
