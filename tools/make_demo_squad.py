#!/usr/bin/env python
"""Writes train.json and dev.json: a small SQuAD v1.1-format set written for megabert's demo.

The paragraphs describe Python's standard library in our own words, the same subject as
the demo's pre-training corpus (the stdlib's docstrings), so a tiny model pre-trained on
the demo corpus has seen the vocabulary. Questions and answers are hand-written; the
answer offsets are computed here, so they are always right. The repo ships its output in
data/squad_demo/; run it after an edit (every demo dataset is made by a tools/make_demo_*.py):

    python tools/make_demo_squad.py                  # -> data/squad_demo/train.json, dev.json
    python tools/make_demo_squad.py --output DIR
"""
import argparse
import json
import os
import sys

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "squad_demo")

# (title, context, [(question, answer), ...]); every answer appears verbatim in its context.
ARTICLES = [
    ("json", "The json module encodes and decodes JSON, a lightweight data interchange format inspired by "
     "JavaScript object literal syntax. The function dumps serializes a Python object to a string, while loads "
     "parses a string and returns the corresponding Python object. Dictionaries become JSON objects and lists "
     "become JSON arrays. The indent parameter makes the output easier for people to read, and sort_keys orders "
     "the keys of every object.",
     [("What format does the json module encode and decode?", "JSON"),
      ("Which function serializes a Python object to a string?", "dumps"),
      ("What syntax inspired the JSON format?", "JavaScript object literal syntax"),
      ("What do lists become in JSON?", "JSON arrays"),
      ("Which parameter orders the keys of every object?", "sort_keys")]),
    ("os", "The os module gives a portable way of using operating system dependent functionality. The function "
     "getcwd returns the current working directory, and chdir changes it. Environment variables are available "
     "through the mapping os.environ. The function listdir returns a list with the names of the entries in a "
     "directory, in arbitrary order, and makedirs creates a directory together with any missing parents.",
     [("What does getcwd return?", "the current working directory"),
      ("Which function changes the current working directory?", "chdir"),
      ("Through which mapping are environment variables available?", "os.environ"),
      ("In what order does listdir return the names?", "arbitrary order"),
      ("Which function creates a directory together with any missing parents?", "makedirs")]),
    ("re", "The re module provides regular expression matching operations similar to those found in Perl. A "
     "pattern is compiled with compile, which returns a pattern object. The function search scans through a "
     "string looking for the first location where the pattern matches, while match only checks the beginning of "
     "the string. Raw string notation, written with an r prefix, keeps backslashes from being treated as escape "
     "characters.",
     [("Regular expression operations in re are similar to those found in which language?", "Perl"),
      ("What does compile return?", "a pattern object"),
      ("Which function only checks the beginning of the string?", "match"),
      ("How is raw string notation written?", "with an r prefix"),
      ("What does raw string notation keep backslashes from being treated as?", "escape characters")]),
    ("collections", "The collections module implements specialized container datatypes as alternatives to "
     "dict, list, set and tuple. A Counter is a dictionary subclass for counting hashable objects. A deque is a "
     "list-like container with fast appends and pops on either end. The function namedtuple creates tuple "
     "subclasses with named fields, and an OrderedDict remembers the order in which keys were first inserted.",
     [("What is a Counter used for?", "counting hashable objects"),
      ("Which container has fast appends and pops on either end?", "deque"),
      ("What does namedtuple create?", "tuple subclasses with named fields"),
      ("What does an OrderedDict remember?", "the order in which keys were first inserted"),
      ("What kind of datatypes does the collections module implement?", "specialized container datatypes")]),
    ("datetime", "The datetime module supplies classes for manipulating dates and times. A date object "
     "represents a date in an idealized calendar, the current Gregorian calendar indefinitely extended in both "
     "directions. A timedelta object represents a duration, the difference between two dates or times. Objects "
     "that carry time zone information are called aware, and objects without it are called naive.",
     [("What does the datetime module supply classes for?", "manipulating dates and times"),
      ("Which calendar does a date object use?", "the current Gregorian calendar"),
      ("What does a timedelta object represent?", "a duration"),
      ("What are objects that carry time zone information called?", "aware"),
      ("What are objects without time zone information called?", "naive")]),
    ("math", "The math module provides access to the mathematical functions defined by the C standard. These "
     "functions cannot be used with complex numbers; the cmath module offers versions that can. The function "
     "sqrt returns the square root of x, floor returns the largest integer less than or equal to x, and the "
     "constant pi holds the ratio of a circle's circumference to its diameter.",
     [("The math functions are defined by which standard?", "the C standard"),
      ("Which module offers functions that work with complex numbers?", "cmath"),
      ("What does sqrt return?", "the square root of x"),
      ("Which function returns the largest integer less than or equal to x?", "floor"),
      ("What ratio does the constant pi hold?", "the ratio of a circle's circumference to its diameter")]),
    ("random", "The random module implements pseudo-random number generators for various distributions. Almost "
     "all of its functions depend on the basic function random, which generates a random float uniformly in the "
     "half-open range from 0.0 to 1.0. Python uses the Mersenne Twister as the core generator. Because it is "
     "completely deterministic, it is not suitable for security purposes; the secrets module should be used "
     "for those instead.",
     [("What does the random module implement?", "pseudo-random number generators"),
      ("What does the basic function random generate?", "a random float"),
      ("What is the core generator that Python uses?", "the Mersenne Twister"),
      ("Why is the generator not suitable for security purposes?", "it is completely deterministic"),
      ("Which module should be used for security purposes?", "the secrets module")]),
    ("pathlib", "The pathlib module offers classes representing filesystem paths with semantics appropriate "
     "for different operating systems. Pure paths provide purely computational operations without I/O, while "
     "concrete paths also provide methods that make system calls. The slash operator joins paths, the name "
     "attribute gives the final path component, and suffix gives its file extension.",
     [("What do the classes of pathlib represent?", "filesystem paths"),
      ("Which paths provide purely computational operations without I/O?", "Pure paths"),
      ("Which operator joins paths?", "The slash operator"),
      ("Which attribute gives the final path component?", "the name attribute"),
      ("What does suffix give?", "its file extension")]),
    ("itertools", "The itertools module implements a number of iterator building blocks inspired by constructs "
     "from APL, Haskell and SML. The function count makes an iterator that returns evenly spaced values, cycle "
     "repeats the elements of an iterable indefinitely, and chain returns elements from the first iterable until "
     "it is exhausted, then proceeds to the next. Together they form an iterator algebra that is fast and memory "
     "efficient.",
     [("Which languages inspired the itertools building blocks?", "APL, Haskell and SML"),
      ("What kind of values does count return?", "evenly spaced values"),
      ("Which function repeats the elements of an iterable indefinitely?", "cycle"),
      ("Which function proceeds to the next iterable once the first is exhausted?", "chain"),
      ("What do the tools form together?", "an iterator algebra")]),
    ("functools", "The functools module is for higher-order functions: functions that act on or return other "
     "functions. The decorator lru_cache wraps a function with a memoizing callable that saves up to the maxsize "
     "most recent calls. The function partial returns a new object which behaves like the original function "
     "called with some arguments fixed, and reduce applies a function of two arguments cumulatively to the items "
     "of an iterable.",
     [("What is the functools module for?", "higher-order functions"),
      ("Which decorator wraps a function with a memoizing callable?", "lru_cache"),
      ("How many recent calls does lru_cache save?", "up to the maxsize most recent calls"),
      ("Which function fixes some arguments of another function?", "partial"),
      ("How many arguments does the function given to reduce take?", "two arguments")]),
    ("sqlite3", "SQLite is a C library that provides a lightweight disk-based database that does not require a "
     "separate server process. The sqlite3 module, written by Gerhard Häring, provides an SQL interface "
     "compliant with the DB-API 2.0 specification described by PEP 249. A connection is opened with connect, "
     "and a cursor object executes SQL statements and fetches their results.",
     [("What kind of database does SQLite provide?", "a lightweight disk-based database"),
      ("What does SQLite not require?", "a separate server process"),
      ("Who wrote the sqlite3 module?", "Gerhard Häring"),
      ("Which PEP describes the DB-API 2.0 specification?", "PEP 249"),
      ("What object executes SQL statements?", "a cursor object")]),
    ("threading", "The threading module constructs higher-level threading interfaces on top of the lower level "
     "_thread module. In CPython, because of the global interpreter lock, only one thread can execute Python code "
     "at once. Threading is therefore still an appropriate model for running multiple I/O-bound tasks "
     "simultaneously, while multiprocessing is recommended to make better use of multi-core machines.",
     [("Which lower-level module is threading built on?", "_thread"),
      ("What allows only one thread to execute Python code at once?", "the global interpreter lock"),
      ("For which tasks is threading still an appropriate model?", "multiple I/O-bound tasks"),
      ("What is recommended to make better use of multi-core machines?", "multiprocessing"),
      ("In which implementation does the global interpreter lock apply?", "CPython")]),
    ("unittest", "The unittest framework was originally inspired by JUnit and has a similar flavor as major unit "
     "testing frameworks in other languages. A test case is created by subclassing unittest.TestCase, and "
     "individual tests are methods whose names start with the letters test. The methods setUp and tearDown run "
     "before and after each test, and a test runner orchestrates the execution of tests and reports the outcome.",
     [("Which framework originally inspired unittest?", "JUnit"),
      ("How is a test case created?", "by subclassing unittest.TestCase"),
      ("With which letters do test method names start?", "test"),
      ("Which method runs after each test?", "tearDown"),
      ("What orchestrates the execution of tests?", "a test runner")]),
    ("argparse", "The argparse module makes it easy to write user-friendly command-line interfaces. The program "
     "defines what arguments it requires, and argparse figures out how to parse those out of sys.argv. The module "
     "also automatically generates help and usage messages and issues errors when users give the program invalid "
     "arguments. Arguments are declared with the add_argument method of an ArgumentParser.",
     [("What kind of interfaces does argparse help write?", "user-friendly command-line interfaces"),
      ("From where does argparse parse the arguments?", "sys.argv"),
      ("What messages does argparse generate automatically?", "help and usage messages"),
      ("Which method declares arguments?", "add_argument"),
      ("Of which class is add_argument a method?", "ArgumentParser")]),
    ("logging", "The logging module defines functions and classes which implement a flexible event logging "
     "system for applications and libraries. Loggers expose the interface that application code uses directly, "
     "handlers send the log records to the appropriate destination, and formatters specify the layout of log "
     "records in the final output. The standard levels, in increasing order of severity, are DEBUG, INFO, "
     "WARNING, ERROR and CRITICAL.",
     [("What kind of system does the logging module implement?", "a flexible event logging system"),
      ("What do handlers do?", "send the log records to the appropriate destination"),
      ("What do formatters specify?", "the layout of log records in the final output"),
      ("Which is the most severe standard level?", "CRITICAL"),
      ("What does application code use directly?", "Loggers")]),
    ("csv", "The so-called CSV format, for comma separated values, is the most common import and export format "
     "for spreadsheets and databases. The csv module implements classes to read and write tabular data in CSV "
     "format. Its reader object iterates over the lines of a file, and the DictReader class maps the information "
     "in each row to a dictionary whose keys are given by the first row.",
     [("What does CSV stand for?", "comma separated values"),
      ("What is CSV the most common format for?", "spreadsheets and databases"),
      ("What kind of data does the csv module read and write?", "tabular data"),
      ("Which class maps each row to a dictionary?", "DictReader"),
      ("Which row gives the keys of a DictReader?", "the first row")]),
    ("hashlib", "The hashlib module implements a common interface to many different secure hash and message "
     "digest algorithms, such as SHA1, SHA224, SHA256, SHA384 and SHA512, as well as the MD5 algorithm. Each "
     "constructor returns a hash object; its update method feeds it bytes, and the digest method returns the "
     "digest of the data passed so far. The hexdigest method returns the same digest as a string of hexadecimal "
     "digits.",
     [("What does hashlib implement a common interface to?", "secure hash and message digest algorithms"),
      ("What does each constructor return?", "a hash object"),
      ("Which method feeds bytes to a hash object?", "update"),
      ("Which method returns the digest as hexadecimal digits?", "The hexdigest method"),
      ("Which older algorithm does hashlib support besides the SHA family?", "MD5")]),
    ("subprocess", "The subprocess module allows a program to spawn new processes, connect to their input, "
     "output and error pipes, and obtain their return codes. It is intended to replace several older modules "
     "and functions such as os.system. The recommended approach is the run function for all use cases it can "
     "handle, while the underlying Popen interface can be used directly for more advanced cases.",
     [("What does the subprocess module allow a program to spawn?", "new processes"),
      ("Which older function does subprocess intend to replace?", "os.system"),
      ("What is the recommended approach for most use cases?", "the run function"),
      ("Which interface can be used for more advanced cases?", "Popen"),
      ("What does subprocess obtain from processes besides their pipes?", "their return codes")]),
    ("heapq", "The heapq module provides an implementation of the heap queue algorithm, also known as the "
     "priority queue algorithm. Heaps are binary trees for which every parent node has a value less than or "
     "equal to any of its children. The implementation uses zero-based indexing and keeps the smallest element "
     "at position zero. The function heappush pushes a value onto the heap, and heappop pops and returns the "
     "smallest item.",
     [("What is the heap queue algorithm also known as?", "the priority queue algorithm"),
      ("What kind of trees are heaps?", "binary trees"),
      ("What indexing does the implementation use?", "zero-based indexing"),
      ("Where is the smallest element kept?", "at position zero"),
      ("Which function pops and returns the smallest item?", "heappop")]),
    ("zipfile", "The ZIP file format is a common archive and compression standard. The zipfile module provides "
     "tools to create, read, write, append and list a ZIP file. It supports decryption of encrypted files in "
     "ZIP archives but cannot create an encrypted file. Decryption is extremely slow because it is implemented "
     "in native Python rather than C.",
     [("What kind of standard is the ZIP file format?", "a common archive and compression standard"),
      ("What can the zipfile module not create?", "an encrypted file"),
      ("How fast is decryption?", "extremely slow"),
      ("Why is decryption slow?", "it is implemented in native Python rather than C"),
      ("Which operations does zipfile provide besides create, read and write?", "append and list")]),
    ("time", "The time module provides various time-related functions. The epoch is the point where the time "
     "starts, and on all platforms it is January 1, 1970, 00:00:00 UTC. The function time returns the time in "
     "seconds since the epoch as a floating point number, sleep suspends execution of the calling thread for the "
     "given number of seconds, and perf_counter returns the value of a clock with the highest available "
     "resolution.",
     [("When is the epoch on all platforms?", "January 1, 1970, 00:00:00 UTC"),
      ("What is the epoch?", "the point where the time starts"),
      ("Which function suspends execution of the calling thread?", "sleep"),
      ("In what unit does time return the time since the epoch?", "seconds"),
      ("Which function returns a clock with the highest available resolution?", "perf_counter")]),
    ("pickle", "The pickle module implements binary protocols for serializing and de-serializing a Python "
     "object structure. Pickling is the process whereby a Python object hierarchy is converted into a byte "
     "stream, and unpickling is the inverse operation. The pickle module is not secure: only unpickle data you "
     "trust, because it is possible to construct malicious pickle data which will execute arbitrary code during "
     "unpickling.",
     [("What kind of protocols does pickle implement?", "binary protocols"),
      ("Into what is an object hierarchy converted by pickling?", "a byte stream"),
      ("What is the inverse operation of pickling called?", "unpickling"),
      ("Which data should you unpickle?", "data you trust"),
      ("What can malicious pickle data do during unpickling?", "execute arbitrary code")]),
    ("statistics", "The statistics module provides functions for calculating mathematical statistics of numeric "
     "data. It is not intended to be a competitor to third-party libraries such as NumPy or SciPy. The function "
     "mean returns the arithmetic average, median returns the middle value, and mode returns the single most "
     "common data point from discrete or nominal data.",
     [("What does the statistics module calculate?", "mathematical statistics of numeric data"),
      ("Which third-party libraries is the module not intended to compete with?", "NumPy or SciPy"),
      ("What does mean return?", "the arithmetic average"),
      ("Which function returns the middle value?", "median"),
      ("What does mode return?", "the single most common data point")]),
    ("gzip", "The gzip module provides a simple interface to compress and decompress files just like the GNU "
     "programs gzip and gunzip would. The data compression is provided by the zlib module. The open function "
     "opens a gzip-compressed file in binary or text mode and returns a file object, and compress returns a "
     "bytes object containing the compressed data.",
     [("Which GNU programs does the gzip module behave like?", "gzip and gunzip"),
      ("Which module provides the data compression?", "the zlib module"),
      ("In which modes can open open a compressed file?", "binary or text mode"),
      ("What does compress return?", "a bytes object containing the compressed data"),
      ("What does the open function return?", "a file object")]),
    # dev articles start here (see DEV_TITLES)
    ("shutil", "The shutil module offers a number of high-level operations on files and collections of files, "
     "in particular functions which support file copying and removal. The function copytree recursively copies "
     "an entire directory tree, rmtree deletes one, and move recursively moves a file or directory to another "
     "location. For operations on individual files, see also the os module.",
     [("What kind of operations does shutil offer?", "high-level operations on files"),
      ("Which function recursively copies an entire directory tree?", "copytree"),
      ("Which function deletes an entire directory tree?", "rmtree"),
      ("What does move do?", "recursively moves a file or directory to another location"),
      ("Which module covers operations on individual files?", "the os module")]),
    ("string", "The string module contains a number of useful constants and classes. The constant "
     "ascii_letters is the concatenation of the ascii_lowercase and ascii_uppercase constants, and digits is the "
     "string 0123456789. The Formatter class lets you create and customize your own string formatting behaviors "
     "using the same implementation as the built-in format method.",
     [("What does the string module contain?", "useful constants and classes"),
      ("What is ascii_letters the concatenation of?", "the ascii_lowercase and ascii_uppercase constants"),
      ("What string is digits?", "0123456789"),
      ("Which class customizes string formatting behaviors?", "The Formatter class"),
      ("Which built-in method shares the Formatter implementation?", "format")]),
    ("socket", "The socket module provides access to the BSD socket interface. It is available on all modern "
     "Unix systems, Windows, MacOS, and probably additional platforms. The Python interface is a "
     "straightforward transliteration of the Unix system call and library interface for sockets to Python's "
     "object-oriented style: the socket function returns a socket object whose methods implement the various "
     "socket system calls.",
     [("Which interface does the socket module give access to?", "the BSD socket interface"),
      ("On which systems is the socket module available?", "all modern Unix systems, Windows, MacOS"),
      ("What is the Python interface a transliteration of?", "the Unix system call and library interface"),
      ("What does the socket function return?", "a socket object"),
      ("What do the methods of a socket object implement?", "the various socket system calls")]),
    ("tempfile", "The tempfile module creates temporary files and directories. It works on all supported "
     "platforms. TemporaryFile and NamedTemporaryFile are high-level interfaces which provide automatic cleanup "
     "and can be used as context managers. The function mkdtemp creates a temporary directory, and the user is "
     "responsible for deleting it when done with it.",
     [("What does the tempfile module create?", "temporary files and directories"),
      ("On which platforms does tempfile work?", "all supported platforms"),
      ("What do the high-level interfaces provide?", "automatic cleanup"),
      ("Which function creates a temporary directory?", "mkdtemp"),
      ("Who is responsible for deleting the directory made by mkdtemp?", "the user")]),
    ("enum", "An enumeration is a set of symbolic names bound to unique values. Enumerations are similar to "
     "global variables, but they offer a more useful repr, grouping, type-safety, and a few other features. They "
     "are created with class syntax by subclassing Enum, and the auto helper can be used to fill in values "
     "automatically when the exact value is unimportant.",
     [("What is an enumeration?", "a set of symbolic names bound to unique values"),
      ("What are enumerations similar to?", "global variables"),
      ("Which class is subclassed to create an enumeration?", "Enum"),
      ("Which helper fills in values automatically?", "auto"),
      ("When can auto be used?", "when the exact value is unimportant")]),
    ("bisect", "The bisect module provides support for maintaining a list in sorted order without having to "
     "sort the list after each insertion. For long lists of items with expensive comparison operations, this can "
     "be an improvement over linear searches or frequent resorting. The module is called bisect because it uses "
     "a basic bisection algorithm to do its work.",
     [("What does bisect help maintain?", "a list in sorted order"),
      ("What does bisect avoid after each insertion?", "sort the list"),
      ("For what kind of lists is bisect an improvement?", "long lists of items with expensive comparison operations"),
      ("What could bisect be an improvement over?", "linear searches or frequent resorting"),
      ("Why is the module called bisect?", "it uses a basic bisection algorithm")]),
    ("textwrap", "The textwrap module provides some convenience functions, as well as TextWrapper, the class "
     "that does all the work. The function wrap wraps a single paragraph in text so every line is at most width "
     "characters long and returns a list of output lines. The function dedent removes any common leading "
     "whitespace from every line, which is useful for triple-quoted strings.",
     [("Which class does all the work in textwrap?", "TextWrapper"),
      ("What does wrap return?", "a list of output lines"),
      ("How long is every line after wrap?", "at most width characters long"),
      ("What does dedent remove?", "any common leading whitespace"),
      ("For which strings is dedent useful?", "triple-quoted strings")]),
    ("copy", "Assignment statements in Python do not copy objects; they create bindings between a target and "
     "an object. The copy module provides generic shallow and deep copy operations. A shallow copy constructs a "
     "new compound object and inserts references into it to the objects found in the original, while a deep "
     "copy inserts copies of them recursively.",
     [("What do assignment statements create?", "bindings between a target and an object"),
      ("What operations does the copy module provide?", "generic shallow and deep copy operations"),
      ("What does a shallow copy insert into the new object?", "references"),
      ("How does a deep copy insert copies of the objects?", "recursively"),
      ("What do assignment statements not do?", "copy objects")]),
]
DEV_TITLES = {"shutil", "string", "socket", "tempfile", "enum", "bisect", "textwrap", "copy"}


def squad(articles, split):
    data = []
    for a, (title, context, qas) in enumerate(articles):
        items = []
        for q, (question, answer) in enumerate(qas):
            start = context.find(answer)
            if start < 0:
                raise ValueError(f"{title}: answer {answer!r} is not in the context")
            items.append({"id": f"{split}-{title}-{q}", "question": question,
                          "answers": [{"text": answer, "answer_start": start}]})
        data.append({"title": title, "paragraphs": [{"context": context, "qas": items}]})
    return {"version": "1.1", "data": data}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default=SHIPPED, help="Directory for train.json and dev.json (default: %(default)s).")
    args = p.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    train = [a for a in ARTICLES if a[0] not in DEV_TITLES]
    dev = [a for a in ARTICLES if a[0] in DEV_TITLES]
    for name, articles in (("train", train), ("dev", dev)):
        with open(os.path.join(args.output, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(squad(articles, name), f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(f"wrote {os.path.join(args.output, name)}.json: {sum(len(a[2]) for a in articles)} questions")


if __name__ == "__main__":
    sys.exit(main())
