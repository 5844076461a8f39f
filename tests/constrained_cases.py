"""The schemas, regex and tool the speculative-decoding tests constrain
requests with, in process (tests/unit/test_speculative_ngram.py) and
through the services (tests/integration/test_speculative.py)."""

PET = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 1, "maximum": 99},
                                        "pet": {"enum": ["cat", "dog"]}},
       "required": ["age", "pet"], "additionalProperties": False}
AGES = r"([A-Z][a-z]+ is [0-9]{2}\. ){2}[A-Z][a-z]+ is [0-9]{2}\."
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a", "b"], "additionalProperties": False}}}
