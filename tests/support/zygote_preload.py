"""Imported by the test zygote before it forks (tests/launch/test_zygote.py): a child that sees
this module in sys.modules did not import it itself. Like vLLM's env_override, it sets a
variable in the environment as it is imported, which every forked child must see."""

import os

IMPORTED = True
os.environ["ZYGOTE_TEST_SET_AT_IMPORT"] = "yes"
print("printed while imported, never parsed as a report")
