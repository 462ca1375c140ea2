"""Reward-model training (RLHF): Bradley-Terry on preference pairs, evaluation, publication, registration."""
