"""Tools for the tool-calling tests: a function with a bounded schema and one without
parameters, and the check that a call's arguments satisfy them."""

import json

WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "now"}}]


def satisfied(name: str, arguments: str) -> bool:
    """A call of TOOLS' functions whose arguments (JSON text) satisfy its schema."""
    args = json.loads(arguments)
    if name == "now":
        return args == {}
    return (name == "get_weather" and set(args) == {"city", "days"}
            and isinstance(args["city"], str) and len(args["city"]) <= 10
            and isinstance(args["days"], int) and 1 <= args["days"] <= 7)
