"""Stands in for jsonschema's optional IRI checker during the test suite (see the root conftest.py):
importing it fails, as if it were not installed, so jsonschema leaves the "iri" formats unchecked."""
raise ImportError("rfc3987_syntax is hidden from the test suite's processes (conftest.py, HIDDEN_MODULES)")
