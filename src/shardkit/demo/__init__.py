"""The main job: ``shardkit demo`` trains a small LM with every available strategy on a task with a known floor.

:mod:`shardkit.demo.task` holds the synthetic language (a Markov chain whose entropy rate is the lowest
achievable loss); :mod:`shardkit.demo.train` launches the workers and prints the table.
"""
