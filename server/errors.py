"""The error every request parser raises: HTTP status plus an OpenAI-style error body."""

from __future__ import annotations


class ProtocolError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.err_type = message, param, code, status, err_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}
