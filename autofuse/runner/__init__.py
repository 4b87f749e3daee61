"""The trial process: typed requests and results (`protocol`), the runners that isolate a trial in a child
process or run it inline (`process`), what a trial does there (`evaluator`), and correctness checks and device
timing (`measure`). Importing the package loads none of them."""
