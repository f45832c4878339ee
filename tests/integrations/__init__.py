"""A package only so that pytest puts tests/, not this folder, on sys.path for test_ledger.py: with
this folder on the path its vllm/ and sglang/ folders would answer ``import vllm`` and ``import
sglang`` in the test process (as empty namespace packages) where those engines are not installed."""
