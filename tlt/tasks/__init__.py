"""Built-in tasks: data generators and their reward functions.

SCORERS maps a data_source pattern to the verl-shaped reward function of the task that writes such rows;
tlt.rl.rewards registers them next to its own. The dependency is one-way: tasks never import the reward machinery.
"""
from tlt.tasks import default_task, longtail_sort

SCORERS = {"tlt/*": default_task.score, "tlt-longtail/*": longtail_sort.score}  # data_source pattern ("prefix*" matches by prefix) -> reward function
