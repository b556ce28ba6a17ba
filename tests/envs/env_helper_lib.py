"""A helper imported by uses_helper.py (not an env file itself)."""

import re


def extract_number(text):
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None
