"""Imported by the test zygote before it forks (tests/launch/test_zygote.py): a child that sees
this module in sys.modules did not import it itself."""

IMPORTED = True
