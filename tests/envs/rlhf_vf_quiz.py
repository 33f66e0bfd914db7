"""A verifiers 0.4 taskset written for tests/envs: a two-row quiz whose env plays a scripted user (a hint after a
wrong answer, three tries), scored by the task's own rewards. ``verifiers:rlhf_vf_quiz`` (tests/envs on the path)."""

import verifiers.v1 as vf


class QuizData(vf.TaskData):
    answer: str
    hint: str
    broken: bool = False


class QuizTask(vf.Task[QuizData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.broken:
            raise ValueError("this rubric cannot score")
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def quick(self, trace: vf.Trace) -> float:
        return 1.0 / max(trace.num_turns, 1)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)

    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return "i give up" in trace.last_reply.lower()


class QuizEnv(vf.SingleAgentEnv):
    """The scripted user: up to three tries, a hint after each wrong one."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            tries = 1
            while not segment.terminated and segment.last_reply != task.data.answer and tries < 3:
                segment = await interaction.turn(f"Not quite. Hint: {task.data.hint}")
                tries += 1


class QuizTaskset(vf.Taskset[QuizTask, vf.TasksetConfig]):
    def load(self):
        rows = [
            QuizData(prompt="What is the capital of France?", answer="Paris", hint="it starts with P"),
            QuizData(prompt="What is 6 * 7?", answer="42", hint="more than 40"),
            QuizData(prompt="Name a prime.", answer="2", hint="even", broken=True),
        ]
        for row in rows:
            yield QuizTask(row.model_copy(update={"system_prompt": "Answer with one word."}), self.config.task)


__all__ = ["QuizEnv", "QuizTaskset"]
