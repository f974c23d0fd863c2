"""The built-in programming problems, written for envhub: statement, reference solution, hidden test inputs.

Expected outputs are not stored: :mod:`.tasks` computes them by running the trusted reference
solutions in process, so a problem is one short entry here. ``CALL`` problems are graded on the
return value of ``entry_point(*args)``; ``IO`` problems on what the program prints for a stdin.
"""

from __future__ import annotations

from typing import Any

# (id, statement, entry_point, reference, [args tuple per hidden test])
CALL: list[tuple[str, str, str, str, list[tuple[Any, ...]]]] = [
    ("sum_list", "Return the sum of a list of integers.", "sum_list",
     "def sum_list(xs):\n    return sum(xs)", [([],), ([1, 2, 3],), ([-5, 5, 10],), ([10**12, 1],)]),
    ("reverse_string", "Return the string reversed.", "reverse_string",
     "def reverse_string(s):\n    return s[::-1]", [("",), ("abc",), ("racecar",), ("Hello, World",)]),
    ("is_palindrome", "Return True if the string reads the same backwards, ignoring case and non-alphanumeric "
     "characters.", "is_palindrome",
     "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]",
     [("A man, a plan, a canal: Panama",), ("hello",), ("",), ("No 'x' in Nixon",), ("ab",)]),
    ("fizzbuzz", "Return a list of strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for 5, 'FizzBuzz' for both, "
     "else the number.", "fizzbuzz",
     "def fizzbuzz(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 "
     "else str(i) for i in range(1, n + 1)]", [(1,), (5,), (15,), (0,)]),
    ("factorial", "Return n! for n >= 0.", "factorial",
     "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r", [(0,), (1,), (5,), (20,), (30,)]),
    ("fibonacci", "Return the n-th Fibonacci number (fib(0) = 0, fib(1) = 1).", "fibonacci",
     "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
     [(0,), (1,), (10,), (50,), (90,)]),
    ("count_vowels", "Return how many vowels (a, e, i, o, u, either case) the string contains.", "count_vowels",
     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)", [("",), ("hello",), ("AEIOUxyz",), ("rhythm",)]),
    ("max_subarray", "Return the largest sum of a non-empty contiguous subarray.", "max_subarray",
     "def max_subarray(xs):\n    best = cur = xs[0]\n    for x in xs[1:]:\n        cur = max(x, cur + x)\n"
     "        best = max(best, cur)\n    return best", [([1],), ([-2, 1, -3, 4, -1, 2, 1, -5, 4],), ([-3, -1, -2],), ([5, 4, -1, 7, 8],)]),
    ("two_sum", "Return the indices [i, j] (i < j) of the two numbers that add up to target; exactly one pair exists.",
     "two_sum", "def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n        if target - x in seen:\n"
     "            return [seen[target - x], j]\n        seen[x] = j", [([2, 7, 11, 15], 9), ([3, 2, 4], 6), ([3, 3], 6), ([1, 5, 9, 14], 23)]),
    ("is_prime", "Return True if n is a prime number.", "is_prime",
     "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
     "            return False\n        i += 1\n    return True", [(0,), (1,), (2,), (17,), (21,), (7919,), (1000001,)]),
    ("primes_below", "Return the sorted list of primes smaller than n.", "primes_below",
     "def primes_below(n):\n    s = [True] * max(n, 2)\n    s[0] = s[1] = False\n    for i in range(2, int(n ** 0.5) + 1):\n"
     "        if s[i]:\n            s[i*i::i] = [False] * len(s[i*i::i])\n    return [i for i in range(n) if s[i]]",
     [(0,), (2,), (10,), (50,)]),
    ("gcd", "Return the greatest common divisor of two non-negative integers (gcd(0, 0) = 0).", "gcd",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a", [(0, 0), (12, 18), (17, 5), (0, 9), (1071, 462)]),
    ("lcm_list", "Return the least common multiple of a non-empty list of positive integers.", "lcm_list",
     "from math import gcd\ndef lcm_list(xs):\n    r = 1\n    for x in xs:\n        r = r * x // gcd(r, x)\n    return r",
     [([1],), ([4, 6],), ([2, 3, 5, 7],), ([12, 15, 20],)]),
    ("anagrams", "Return True if the two strings are anagrams of each other (case-sensitive).", "anagrams",
     "def anagrams(a, b):\n    return sorted(a) == sorted(b)", [("listen", "silent"), ("abc", "abd"), ("", ""), ("aab", "aba")]),
    ("group_anagrams", "Group words that are anagrams; return the groups as lists sorted alphabetically, and the groups "
     "sorted by their first word.", "group_anagrams",
     "def group_anagrams(words):\n    g = {}\n    for w in words:\n        g.setdefault(''.join(sorted(w)), []).append(w)\n"
     "    return sorted(sorted(v) for v in g.values())",
     [(["eat", "tea", "tan", "ate", "nat", "bat"],), ([],), (["a"],)]),
    ("word_count", "Return a dict mapping each lowercase word (split on whitespace) to its count.", "word_count",
     "def word_count(text):\n    d = {}\n    for w in text.lower().split():\n        d[w] = d.get(w, 0) + 1\n    return d",
     [("the cat the hat",), ("",), ("A a A b",)]),
    ("flatten", "Flatten an arbitrarily nested list of integers into a flat list, keeping order.", "flatten",
     "def flatten(xs):\n    out = []\n    for x in xs:\n        out.extend(flatten(x) if isinstance(x, list) else [x])\n"
     "    return out", [([],), ([1, [2, [3, [4]]], 5],), ([[[]], [1]],)]),
    ("binary_search", "Return the index of target in the sorted list, or -1 if absent.", "binary_search",
     "def binary_search(xs, t):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        m = (lo + hi) // 2\n"
     "        if xs[m] == t:\n            return m\n        if xs[m] < t:\n            lo = m + 1\n        else:\n"
     "            hi = m - 1\n    return -1", [([], 1), ([1, 3, 5, 7], 5), ([1, 3, 5, 7], 4), ([2], 2)]),
    ("merge_sorted", "Merge two sorted lists into one sorted list.", "merge_sorted",
     "def merge_sorted(a, b):\n    return sorted(a + b)", [([], []), ([1, 4], [2, 3]), ([1, 1], [1]), ([-1, 5], [])]),
    ("rotate_list", "Rotate the list to the right by k steps (k may exceed the length).", "rotate_list",
     "def rotate_list(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[-k:] + xs[:-k] if k else list(xs)",
     [([1, 2, 3, 4, 5], 2), ([], 3), ([1, 2], 5), ([1], 0)]),
    ("valid_parentheses", "Return True if the brackets ()[]{} in the string are balanced and properly nested.",
     "valid_parentheses", "def valid_parentheses(s):\n    st, pairs = [], {')': '(', ']': '[', '}': '{'}\n    for c in s:\n"
     "        if c in '([{':\n            st.append(c)\n        elif c in pairs:\n            if not st or st.pop() != pairs[c]:\n"
     "                return False\n    return not st", [("()[]{}",), ("(]",), ("([)]",), ("",), ("{[()()]}",), ("((",)]),
    ("roman_to_int", "Convert a Roman numeral (I..MMMCMXCIX) to an integer.", "roman_to_int",
     "def roman_to_int(s):\n    v = dict(I=1, V=5, X=10, L=50, C=100, D=500, M=1000)\n    t = 0\n    for i, c in enumerate(s):\n"
     "        t += -v[c] if i + 1 < len(s) and v[s[i + 1]] > v[c] else v[c]\n    return t",
     [("III",), ("IV",), ("LVIII",), ("MCMXCIV",), ("MMMCMXCIX",)]),
    ("int_to_roman", "Convert an integer 1..3999 to a Roman numeral.", "int_to_roman",
     "def int_to_roman(n):\n    out = ''\n    for v, s in [(1000,'M'),(900,'CM'),(500,'D'),(400,'CD'),(100,'C'),(90,'XC'),(50,'L'),"
     "(40,'XL'),(10,'X'),(9,'IX'),(5,'V'),(4,'IV'),(1,'I')]:\n        while n >= v:\n            out += s\n            n -= v\n"
     "    return out", [(1,), (4,), (58,), (1994,), (3999,)]),
    ("digit_sum", "Return the sum of the decimal digits of a non-negative integer.", "digit_sum",
     "def digit_sum(n):\n    return sum(map(int, str(n)))", [(0,), (9,), (12345,), (10**20 + 7,)]),
    ("collatz_steps", "Return how many Collatz steps (n -> n/2 if even else 3n+1) it takes to reach 1.",
     "collatz_steps", "def collatz_steps(n):\n    k = 0\n    while n != 1:\n        n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
     "        k += 1\n    return k", [(1,), (6,), (27,), (97,)]),
    ("run_length_encode", "Run-length encode a string: 'aaabcc' -> 'a3b1c2'.", "run_length_encode",
     "def run_length_encode(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
     "            j += 1\n        out.append(f'{s[i]}{j - i}')\n        i = j\n    return ''.join(out)",
     [("",), ("aaabcc",), ("abc",), ("zzzzzzzzzzzz",)]),
    ("caesar_cipher", "Shift each ASCII letter by k positions in the alphabet (wrapping, keeping case); leave other "
     "characters unchanged.", "caesar_cipher",
     "def caesar_cipher(s, k):\n    def sh(c):\n        if c.isascii() and c.isalpha():\n            b = ord('A') if c.isupper() else ord('a')\n"
     "            return chr((ord(c) - b + k) % 26 + b)\n        return c\n    return ''.join(map(sh, s))",
     [("abc", 1), ("xyz", 3), ("Hello, World!", 13), ("abc", -1), ("", 5)]),
    ("transpose", "Return the transpose of a rectangular matrix given as a list of rows.", "transpose",
     "def transpose(m):\n    return [list(r) for r in zip(*m)]", [([[1, 2, 3], [4, 5, 6]],), ([[1]],), ([],)]),
    ("matrix_multiply", "Multiply two matrices (lists of rows) with compatible shapes.", "matrix_multiply",
     "def matrix_multiply(a, b):\n    return [[sum(x * y for x, y in zip(r, c)) for c in zip(*b)] for r in a]",
     [([[1, 2], [3, 4]], [[5, 6], [7, 8]]), ([[2]], [[3]]), ([[1, 0, 2]], [[1], [2], [3]])]),
    ("unique_in_order", "Return the elements of the list without duplicates, keeping first occurrences in order.",
     "unique_in_order", "def unique_in_order(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
     "            seen.add(x)\n            out.append(x)\n    return out", [([],), ([3, 1, 3, 2, 1],), (["a", "b", "a"],)]),
    ("second_largest", "Return the second largest distinct value in the list, or None if there is none.",
     "second_largest", "def second_largest(xs):\n    s = sorted(set(xs))\n    return s[-2] if len(s) > 1 else None",
     [([1, 2, 3],), ([5, 5],), ([],), ([-1, -7, -1, 3],)]),
    ("mean", "Return the arithmetic mean of a non-empty list of numbers as a float.", "mean",
     "def mean(xs):\n    return sum(xs) / len(xs)", [([1, 2, 3, 4],), ([5],), ([0.5, 0.25],)]),
    ("median", "Return the median of a non-empty list of numbers (the mean of the two middle values for even "
     "lengths, as a float in that case).", "median",
     "def median(xs):\n    s = sorted(xs)\n    n = len(s)\n    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2",
     [([3, 1, 2],), ([4, 1, 3, 2],), ([7],)]),
    ("longest_common_prefix", "Return the longest common prefix of a list of strings ('' for an empty list).",
     "longest_common_prefix", "import os\ndef longest_common_prefix(words):\n    return os.path.commonprefix(words) if words else ''",
     [(["flower", "flow", "flight"],), (["dog", "car"],), ([],), (["same", "same"],)]),
    ("title_case", "Capitalise the first letter of every space-separated word and lowercase the rest.", "title_case",
     "def title_case(s):\n    return ' '.join(w[:1].upper() + w[1:].lower() for w in s.split(' '))",
     [("hello world",), ("",), ("mIxEd CaSe words",)]),
    ("balanced_split", "Return the index i such that sum(xs[:i]) == sum(xs[i:]), the smallest such i, or -1.",
     "balanced_split", "def balanced_split(xs):\n    t, acc = sum(xs), 0\n    for i in range(len(xs) + 1):\n"
     "        if 2 * acc == t:\n            return i\n        if i < len(xs):\n            acc += xs[i]\n    return -1",
     [([1, 2, 3],), ([1, 1],), ([1, 2],), ([],)]),
    ("count_islands", "Count 4-connected groups of 1s in a grid given as a list of rows of 0/1.", "count_islands",
     "def count_islands(g):\n    seen, n = set(), 0\n    for r in range(len(g)):\n        for c in range(len(g[r])):\n"
     "            if g[r][c] == 1 and (r, c) not in seen:\n                n += 1\n                st = [(r, c)]\n"
     "                while st:\n                    y, x = st.pop()\n                    if (y, x) in seen or not (0 <= y < len(g) and 0 <= x < len(g[y])) or g[y][x] != 1:\n"
     "                        continue\n                    seen.add((y, x))\n                    st += [(y+1, x), (y-1, x), (y, x+1), (y, x-1)]\n"
     "    return n", [([[1, 1, 0], [0, 0, 1], [1, 0, 1]],), ([],), ([[0, 0], [0, 0]],)]),
    ("climb_stairs", "Return the number of ways to climb n stairs taking 1 or 2 steps at a time.", "climb_stairs",
     "def climb_stairs(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a", [(0,), (1,), (5,), (40,)]),
    ("coin_change", "Return the fewest coins needed to make amount from unlimited coins of the given values, or -1.",
     "coin_change", "def coin_change(coins, amount):\n    inf = float('inf')\n    d = [0] + [inf] * amount\n"
     "    for a in range(1, amount + 1):\n        for c in coins:\n            if c <= a and d[a - c] + 1 < d[a]:\n"
     "                d[a] = d[a - c] + 1\n    return d[amount] if d[amount] != inf else -1",
     [([1, 2, 5], 11), ([2], 3), ([1], 0), ([3, 7], 17)]),
    ("edit_distance", "Return the Levenshtein distance between two strings.", "edit_distance",
     "def edit_distance(a, b):\n    d = list(range(len(b) + 1))\n    for i, x in enumerate(a, 1):\n        p, d[0] = d[0], i\n"
     "        for j, y in enumerate(b, 1):\n            p, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, p + (x != y))\n    return d[-1]",
     [("kitten", "sitting"), ("", "abc"), ("same", "same"), ("flaw", "lawn")]),
    ("longest_increasing", "Return the length of the longest strictly increasing subsequence.", "longest_increasing",
     "import bisect\ndef longest_increasing(xs):\n    t = []\n    for x in xs:\n        i = bisect.bisect_left(t, x)\n"
     "        t[i:i + 1] = [x]\n    return len(t)", [([],), ([10, 9, 2, 5, 3, 7, 101, 18],), ([5, 5, 5],), ([1, 2, 3],)]),
    ("to_binary", "Return the binary representation of a non-negative integer without a prefix.", "to_binary",
     "def to_binary(n):\n    return bin(n)[2:]", [(0,), (5,), (255,), (1024,)]),
    ("chunk_list", "Split the list into consecutive chunks of size k (the last one may be shorter).", "chunk_list",
     "def chunk_list(xs, k):\n    return [xs[i:i + k] for i in range(0, len(xs), k)]", [([1, 2, 3, 4, 5], 2), ([], 3), ([1], 1)]),
    ("pascal_row", "Return row n (0-based) of Pascal's triangle.", "pascal_row",
     "def pascal_row(n):\n    r = [1]\n    for _ in range(n):\n        r = [1] + [a + b for a, b in zip(r, r[1:])] + [1]\n    return r",
     [(0,), (1,), (4,), (10,)]),
    ("char_frequency", "Return the most frequent character of a non-empty string (the alphabetically smallest on ties).",
     "char_frequency", "from collections import Counter\ndef char_frequency(s):\n    c = Counter(s)\n"
     "    return min(c, key=lambda ch: (-c[ch], ch))", [("hello",), ("aabb",), ("z",)]),
    ("sort_by_length", "Sort strings by length, then alphabetically.", "sort_by_length",
     "def sort_by_length(ws):\n    return sorted(ws, key=lambda w: (len(w), w))", [(["bb", "a", "ccc", "ab"],), ([],)]),
]

# (id, statement, reference program, [stdin per hidden test])
IO: list[tuple[str, str, str, list[str]]] = [
    ("io_sum_two", "Read two integers on one line and print their sum.",
     "a, b = map(int, input().split())\nprint(a + b)", ["1 2\n", "-5 5\n", "1000000000000 1\n"]),
    ("io_reverse_lines", "Read all lines and print them in reverse order.",
     "import sys\nfor line in reversed(sys.stdin.read().splitlines()):\n    print(line)", ["a\nb\nc\n", "one\n", ""]),
    ("io_count_words", "Read a text and print the number of whitespace-separated words.",
     "import sys\nprint(len(sys.stdin.read().split()))", ["hello world\n", "", "a b\nc  d e\n"]),
    ("io_max_of_n", "The first line holds n; the second line holds n integers. Print the largest.",
     "input()\nprint(max(map(int, input().split())))", ["3\n1 9 4\n", "1\n-7\n", "5\n5 5 5 5 5\n"]),
    ("io_triangle", "Read n and print a right triangle of '*' with n rows (row i has i stars).",
     "n = int(input())\nfor i in range(1, n + 1):\n    print('*' * i)", ["1\n", "3\n", "0\n"]),
    ("io_sort_numbers", "Read integers (whitespace-separated) and print them sorted ascending, one line, space-separated.",
     "import sys\nprint(*sorted(map(int, sys.stdin.read().split())))", ["3 1 2\n", "5\n", "10 -1\n7 7\n"]),
    ("io_char_histogram", "Read one line and print each distinct letter (lowercased, alphabetical) with its count as "
     "'letter count', one per line; ignore non-letters.",
     "from collections import Counter\nc = Counter(ch.lower() for ch in input() if ch.isalpha())\n"
     "for k in sorted(c):\n    print(k, c[k])", ["Hello\n", "a1!A\n", "xyz zz\n"]),
    ("io_running_total", "Read integers one per line and print the running total after each.",
     "import sys\nt = 0\nfor line in sys.stdin.read().split():\n    t += int(line)\n    print(t)", ["1\n2\n3\n", "5\n", "-1\n1\n"]),
]
