"""Token counting tests; CORPUS is the multilingual text every adapter is checked on."""

CORPUS = (
    "hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器。",
    "お誕生日おめでとう",
    "안녕하세요. 오늘 날씨가 정말 좋네요.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "I love it 😀🎉👍🏽 🇫🇷 ❤️‍🔥!",
    "用户说：please summarise 这篇文章 in 3 bullet points 👍",
    "   leading spaces, trailing spaces   \n\n\n tabs\tand\r\nCRLF",
    "1234567890 3.14159 2 + 2 = 4 x**2",
    "it's they're we've I'm you'll he'd IT'S",
    "<|endoftext|> looks special",
)
