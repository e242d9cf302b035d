"""Tasks: examples, chat prompts and rewards, behind one registry (`get_task("countdown", num_train=8)`)."""
from evolm_lib.tasks.base import (
    Example,
    RewardResult,
    Task,
    completion_text,
    get_task,
    list_tasks,
    mean_reward,
    register_task,
    task_options,
)
from evolm_lib.tasks.safe_arith import UnsafeExpressionError, evaluate_expression, numbers_used

# importing the task modules also registers their tasks
from evolm_lib.tasks.arithmetic import ArithmeticTask, arithmetic_reward, generate_arithmetic_problems, last_number
from evolm_lib.tasks.conciseness import ConcisenessTask, length_reward
from evolm_lib.tasks.countdown import (
    CountdownTask,
    countdown_reward,
    generate_countdown_puzzles,
    load_countdown_json,
)
from evolm_lib.tasks.jsonl import JsonlTask, load_jsonl_examples

__all__ = [
    "ArithmeticTask",
    "ConcisenessTask",
    "CountdownTask",
    "Example",
    "JsonlTask",
    "RewardResult",
    "Task",
    "UnsafeExpressionError",
    "arithmetic_reward",
    "completion_text",
    "countdown_reward",
    "evaluate_expression",
    "generate_arithmetic_problems",
    "generate_countdown_puzzles",
    "get_task",
    "last_number",
    "length_reward",
    "list_tasks",
    "load_countdown_json",
    "load_jsonl_examples",
    "mean_reward",
    "numbers_used",
    "register_task",
    "task_options",
]
